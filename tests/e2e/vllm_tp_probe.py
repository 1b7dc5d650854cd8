"""A worker extension for tests/e2e/test_vllm_tensor_parallel_pull.py: the real one plus a report of
what its pull selects (the worker processes import it by name, from tests/e2e on PYTHONPATH)."""

from staleflow.engines.vllm_worker import StaleflowWorkerExtension


class ProbeExtension(StaleflowWorkerExtension):
    def probe_plan(self, url: str, version: int) -> dict:
        """What this worker's pull selects: tensors cut, bytes pulled vs the version's."""
        from staleflow.engines.vllm_tp import _recorded, plan_tp_slices
        from staleflow.transports.client import ParamsClient
        from staleflow.transports.selection import region_of

        with ParamsClient(url) as params:
            manifest = params.manifest(version)
        model = self.model_runner.model
        plan = plan_tp_slices(model, {s.name: s.shape for s in manifest.tensors})
        layer = model.model.layers[0].self_attn.qkv_proj
        return {"tp_rank": layer.tp_rank, "tp_size": layer.tp_size, "kv_replicas": layer.num_kv_head_replicas,
                "cut": sum(p is not None for p in plan.select.values()), "tensors": len(plan.select),
                "pulled_bytes": sum(region_of(s, plan.select[s.name])[1].nbytes for s in manifest.tensors),
                "version_bytes": sum(s.nbytes for s in manifest.tensors),
                "k_proj": str(plan.select["model.layers.0.self_attn.k_proj.weight"]),
                "recorded": _recorded(layer, "weight") is not None,
                "live_weight": f"{type(layer.weight).__name__} {tuple(layer.weight.shape)} {sorted(layer.weight.__dict__)}",
                "marks_restored": all(p.__dict__.get("tp_rank", layer.tp_rank) == layer.tp_rank
                                      and "is_sharded_weight" not in p.__dict__
                                      for p in (layer.weight, layer.bias, _recorded(layer, "weight"),
                                                _recorded(layer, "bias")) if p is not None)}
