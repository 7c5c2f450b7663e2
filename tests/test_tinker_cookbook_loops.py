"""tinker-cookbook 0.6.1's own loops, unchanged and with their default settings, against `tandem serve` on
the tiny chat model: its supervised loop (resumed from its saved state with optimizer, rolling
checkpoints deleted as it goes), its synchronous RL loop and its async RL loop (whose default loss,
stable_reinforce, trains on samples recorded with record_stability_info). The model is named by its
folder, which the cookbook's get_tokenizer loads offline. Nothing is refused and no request outlasts
the SDK's timeouts (each would be a retry the SDK logs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Coroutine, Sequence
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook", reason="the cookbook extra: pip install -e '.[cookbook]'")
import chz  # noqa: E402
from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.rl import train as rl_train  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder  # noqa: E402
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402

from api.settings import ServeSettings  # noqa: E402
from tests.api_util import start_service  # noqa: E402
from tests.tinker_loops import owner_keys, point_sdk  # noqa: E402

pytestmark = pytest.mark.slow
BASE = "tiny-qwen2-chat"
RENDERER = "role_colon"


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    """The service, and the base model's folder: the name the cookbook is given."""
    from controller.models import builtin_model_path

    home = tmp_path_factory.mktemp("cookbook")
    live = start_service(home, settings=ServeSettings(tinker_base_models=[BASE]))
    yield live, str(builtin_model_path(BASE, live.service.home))  # what `tandem models build` prints
    live.stop()


@pytest.fixture
def model(served, monkeypatch, caplog):
    live, folder = served
    point_sdk(monkeypatch, live.url, owner_keys(live, ("carol",))["carol"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    caplog.set_level(logging.WARNING)
    yield folder
    retried = [r.getMessage() for r in caplog.records if "Retrying request" in r.getMessage()]
    assert not [m for m in retried if "try_again" not in m], retried  # a timeout or a refusal, retried


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbooks_supervised_loop_learns_and_resumes_from_its_state(model, tmp_path):
    data = tmp_path / "conversations.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(8) for b in range(8)]  # fmt: skip
    data.write_text("\n".join(json.dumps(r) for r in rows))
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name=RENDERER,
                                            max_length=64, batch_size=16)  # fmt: skip
    config = sl_train.Config(log_path=str(tmp_path / "sl"), model_name=model, recipe_name="tandem_cookbook_test",
                             renderer_name=RENDERER, learning_rate=2e-2, lora_rank=8, save_every=2,
                             rolling_save_every=1, num_epochs=3,
                             dataset_builder=FromConversationFileBuilder(file_path=str(data), common_config=common))  # fmt: skip
    asyncio.run(stopped_after(sl_train.main(config), tmp_path / "sl" / "metrics.jsonl", steps=5))
    asyncio.run(sl_train.main(config))  # resumes from its last saved state, optimizer included
    steps = metrics(tmp_path / "sl")
    assert steps[-1]["step"] == 11 and len(steps) < 16, "it resumed from a state, not from the start"
    nll = [m["train_mean_nll"] for m in steps]
    assert nll[-1] < 0.6 * nll[0], nll


async def stopped_after(run: Coroutine, metrics_file: Path, steps: int) -> None:
    """`run` until it has logged `steps` steps, then stopped as a killed process would be."""
    task = asyncio.ensure_future(run)
    while not task.done() and not (
        metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= steps
    ):
        await asyncio.sleep(0.1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class DigitEnv(ProblemEnv):
    """Reward 1 for an answer that holds a digit: a tiny random model finds some and learns more."""

    def get_question(self) -> str:
        return "Say a digit."

    def check_answer(self, sample_str: str) -> bool:
        return any(ch.isdigit() for ch in sample_str)

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "7"


class DigitDataset(RLDataset):
    def __init__(self, model: str, groups: int, group_size: int) -> None:
        self.renderer = renderers.get_renderer(RENDERER, get_tokenizer(model))
        self.groups, self.group_size = groups, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [ProblemGroupBuilder(lambda: DigitEnv(self.renderer, format_coef=0.0), self.group_size)
                for _ in range(self.groups)]  # fmt: skip

    def __len__(self) -> int:
        return 1000


@chz.chz
class DigitBuilder(RLDatasetBuilder):
    model: str
    groups: int = 4
    group_size: int = 4

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return DigitDataset(self.model, self.groups, self.group_size), None


def rl_config(model: str, log_path: Path, **changes) -> rl_train.Config:
    return rl_train.Config(learning_rate=3e-2, dataset_builder=DigitBuilder(model=model), model_name=model,
                           recipe_name="tandem_cookbook_test", renderer_name=RENDERER, max_tokens=4,
                           log_path=str(log_path), lora_rank=8, eval_every=0, save_every=3, max_steps=6,
                           **changes)  # fmt: skip


def test_the_cookbooks_synchronous_rl_loop_runs(model, tmp_path):
    asyncio.run(rl_train.main(rl_config(model, tmp_path / "rl")))
    steps = [m for m in metrics(tmp_path / "rl") if "env/all/reward/total" in m]
    assert len(steps) == 6 and all(0.0 <= m["env/all/reward/total"] <= 1.0 for m in steps)


def test_the_cookbooks_async_rl_loop_runs_with_its_default_stable_reinforce(served, model, tmp_path):
    config = rl_config(model, tmp_path / "async",
                       async_config=rl_train.AsyncConfig(max_steps_off_policy=2, groups_per_batch=4))  # fmt: skip
    assert config.training_loss_fn() == "stable_reinforce" and config.records_stability_info()
    asyncio.run(rl_train.main(config))
    steps = [m for m in metrics(tmp_path / "async") if "env/all/reward/total" in m]
    assert len(steps) >= 6
    assert served[0].server.config.app.state.tinker.records.sequences  # its samples, recorded for training
