"""References to user code: a 'builtin:' prefix names a built-in table's entry exactly, never a path
or a module; the API never imports a module a 'builtin:' reference smuggles in."""

from __future__ import annotations

import pytest

from controller.agent_sandbox import AgentError, load_agent_fn
from controller.rewards import RewardFunctionError, load_reward_fn
from tests.owners_util import as_key, make_key, upload
from workers.environments.base import EnvironmentReferenceError, load_environment_class
from workers.references import is_path_reference, parse_reference

SMUGGLED = [
    "builtin:/../x.py:f",
    "builtin:arithmetic:x",
    "builtin:os:system",
    "builtin:",
    "builtin:../mod.py",
]
LOADERS = [
    (load_reward_fn, RewardFunctionError, "builtin:arithmetic"),
    (load_environment_class, EnvironmentReferenceError, "builtin:calculator"),
    (load_agent_fn, AgentError, None),
]


@pytest.mark.parametrize("ref", SMUGGLED)
def test_a_builtin_prefix_decides_the_form_whatever_follows(ref):
    parsed = parse_reference(ref, "reward function", "forms", ValueError)
    assert (parsed.form, parsed.source, parsed.name) == ("builtin", "", ref.removeprefix("builtin:"))
    assert not is_path_reference(ref)


@pytest.mark.parametrize("ref", SMUGGLED)
@pytest.mark.parametrize(("load", "error", "good"), LOADERS)
def test_loaders_refuse_builtin_names_outside_their_table(load, error, good, ref):
    with pytest.raises(error, match="built-in"):
        load(ref)
    if good is not None:
        assert callable(load(good))


def test_other_forms_split_at_the_last_colon():
    assert parse_reference("a/b.py:f", "x", "", ValueError).form == "file"
    assert parse_reference("pkg.mod:Cls.method", "x", "", ValueError).source == "pkg.mod"
    assert is_path_reference("/srv/mod.py:score") and not is_path_reference("pkg.mod:score")
    for bad in ("a b:c", "mod:", ":f", "mod:f g", 5):
        with pytest.raises(ValueError, match="malformed"):
            parse_reference(bad, "x", "forms", ValueError)


MODULE = """
import os, pathlib
pathlib.Path({marker!r}, f"imported-{{os.getpid()}}").write_text("imported")


def score(prompt, response, ground_truth, extra):
    return 1.0


class Env:
    def reset(self, row):
        return "hi"

    def step(self, text):
        return None, 0.0, True, {{}}
"""


def test_a_builtin_path_is_refused_and_never_imported_by_the_api(unscheduled, tmp_path):
    """The probe: an owner's upload named through 'builtin:/../..' reached the API's importer."""
    with unscheduled.client() as admin:
        key = make_key(admin, "mallory")["key"]
        pid = admin.get("/v1/service").json()["pid"]
    home = unscheduled.service.home
    with as_key(unscheduled, key) as mallory:
        made = upload(mallory, "mod.py", MODULE.format(marker=str(tmp_path)).encode())
        path = f"{'/..' * 12}{home}/files/{made['id']}/mod.py"
        bodies = {
            "reward.function": {"reward": {"function": f"builtin:{path}:score"}},
            "rollout.environment": {"rollout": {"environment": f"builtin:{path}:Env"}},
            "rollout.external.agent": {
                "rollout": {"source": "external", "external": {"agent": f"builtin:{path}:score"}}
            },
        }
        for param, body in bodies.items():
            answer = mallory.post("/v1/jobs/validate", json={"model": {"builtin": "tiny-qwen2"}, **body})
            assert answer.status_code == 422, (param, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param and "built-in" in error["message"], error
    assert not (tmp_path / f"imported-{pid}").exists()
    assert list(tmp_path.iterdir()) == []  # imported nowhere: not even checked in a child
