"""Every setting Tandem takes, declared once: the JobSpec, its sections and the models they hand down.

Torch-free and Ray-free (tests/test_schema.py imports it in a fresh process and checks), so the API,
the CLI and the service validate a job where it arrives, and the controller and the workers receive
the same typed models. Each setting is declared in the lowest model that uses it and inherited by
the JobSpec section that a user writes:

- `job.py`: JobSpec and its small sections (model, data, reward, checkpoint, labels);
- `rollout.py`, `training.py`, `resources.py`: the `rollout`, `optim` / `algorithm` / `trainer`
  and `resources` sections;
- `engine.py`, `workers.py`, `losses.py`, `async_rl.py`, `external.py`: what the training engine,
  the workers, the losses, the async loop and the agents' endpoint are built with;
- `tinker_losses.py`: what each Tinker built-in loss accepts;
- `openai_bodies.py`: the bounded bodies of a job's OpenAI calls, checked by the API and again by the
  job's endpoint actor (an agent the job runs calls it without the API);
- `section.py`: the base of every section and the helpers of cross-section rules.

Besides pydantic, it reads only the engines' registries (names and limits of each engine, no engine
code): a backend is checked against its own entry at submission.
"""
