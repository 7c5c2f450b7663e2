"""The mesh registry lives on the worker instance and the register decorator only declares."""

from __future__ import annotations

import pytest

from workers.base import Dispatch, MethodSpec, Worker, register, registered_methods


class Probe(Worker):
    @register(Dispatch.MESH, mesh="actor")
    def update(self, batch):
        return batch


def test_two_workers_in_one_process_keep_separate_registries(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    first, second = Probe(), Probe()
    first.register_mesh("actor", dp_rank=0, is_collect=True)
    second.register_mesh("actor", dp_rank=1, is_collect=False)
    assert first.mesh_info("actor") == (0, True)
    assert second.mesh_info("actor") == (1, False)
    assert (first.rank, first.world_size) == (1, 2)


def test_registering_a_mesh_twice_raises_naming_it():
    worker = Probe()
    worker.register_mesh("rollout", 0, True)
    with pytest.raises(ValueError, match="mesh 'rollout' is already registered"):
        worker.register_mesh("rollout", 1, True)
    with pytest.raises(KeyError, match="no mesh 'actor' registered"):
        worker.mesh_info("actor")


def test_register_attaches_a_spec_and_validates():
    specs = registered_methods(Probe)
    assert specs["update"] == MethodSpec(Dispatch.MESH, "actor", True)
    assert specs["mesh_info"].mode is Dispatch.ONE_TO_ALL
    with pytest.raises(ValueError, match="needs a mesh name"):
        register(Dispatch.MESH)
    with pytest.raises(ValueError, match="only applies to Dispatch.MESH"):
        register(Dispatch.ONE_TO_ALL, mesh="actor")
