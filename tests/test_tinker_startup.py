"""What the Tinker API finds on disk when the service starts: its samplers lived in memory, so the
unnamed snapshots they sampled from are nobody's now and leave the disk; named ones are checkpoints
in their runs' folders and stay."""

from __future__ import annotations

from service.service import Service
from service.tinker_checkpoints import checkpoint_folder
from service.tinker_service import TinkerService

BASE = "/nonexistent/tinker-base"  # served, never started: only its folder matters here


def test_unnamed_snapshots_left_by_the_last_run_leave_the_disk_at_start(tmp_path):
    first = TinkerService(Service(tmp_path), [BASE])
    snapshot = first.hosts[BASE].workdir / "samplers" / "sess-0:train:0" / "sess-0-sample-1"
    snapshot.mkdir(parents=True)
    (snapshot / "adapter_model.safetensors").write_bytes(b"\0" * 1024)
    named = checkpoint_folder(tmp_path / "jobs" / "job-0", "sampler_weights", "kept")
    named.mkdir(parents=True)
    first.shutdown()
    TinkerService(Service(tmp_path), [BASE])
    assert not snapshot.exists() and named.is_dir()
