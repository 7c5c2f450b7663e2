"""How many files `optim.lr` passes through, from the REST request to the optimizer, the live edit
included (tests/setting_path.py traces a real submission; docs/ARCHITECTURE.md §9)."""

from __future__ import annotations

import pytest

from tests.setting_path import setting_path

# The files the path crosses now; a hop added back (a re-wrap of the section, a second parse or
# validation in another file) raises the count.
MAX_FILES = 12


# A real job through the service (~3 minutes on 2 cores): `make test-slow`. A hop added back shows in
# the structure tests of make test too (tests/test_job_config.py: the section is handed on, not re-made).
@pytest.mark.slow
def test_optim_lr_reaches_the_optimizer_through_few_files(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    path = setting_path()
    # The trace saw both ends: the request and the optimizer (a broken trace would count nothing).
    assert {
        "api/routes/jobs.py",
        "service/store.py",
        "controller/job_setup.py",
        "engines/training/adamw.py",
    } <= set(path)
    assert "FSDPEngine.set_learning_rate" in path["engines/training/fsdp/engine.py"]  # the live edit arrived
    # A learning-rate edit goes to the role's registered operation: no per-setting wrapper on the way.
    assert "controller/groups.py" not in path
    # The section goes to the engine as it is: not re-wrapped (schema/training.py, schema/section.py).
    assert "schema/training.py" not in path and "schema/section.py" not in path
    assert len(path) <= MAX_FILES, f"optim.lr crosses {len(path)} files: {sorted(path)}"
