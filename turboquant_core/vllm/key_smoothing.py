# SPDX-License-Identifier: Apache-2.0
"""Key smoothing at load time for vLLM models with a TurboQuant KV cache (called by ``BaseModelLoader.load_model``,
patch 0008, after the weights are loaded and before ``process_weights_after_loading``).

Per RoPE pair a scale s goes into the keys and 1/s into the queries (``turboquant_core.integrations.key_smoothing``):
every q.k logit is unchanged in full precision, and channels with strong keys and weak queries stop dominating the
compressed keys' error. ``--tq-key-smoothing``: ``auto`` smooths the layers whose q/k-norm gains take the scale
(Qwen3, Gemma 3), where those gains unbalance the key channels; ``all`` also folds it into the k and q rows of
``qkv_proj`` on layers without q/k norms (Llama style), where it was not found to help; ``off`` smooths nothing.
With tensor parallelism the ranks gather each other's statistics over the tensor-parallel group, so every rank folds
the scales a single GPU would.
"""

from torch import nn
from vllm.logger import init_logger

from ..config import TQConfig

# Under vLLM's logger so that its logging configuration (handlers, VLLM_LOGGING_LEVEL) applies.
logger = init_logger(f"vllm.{__name__}")


def tq_key_smoothing(model: nn.Module, vllm_config) -> None:
    """Fold key smoothing into ``model``'s attention weights as ``vllm_config``'s TurboQuant options say."""
    mode = TQConfig.from_vllm(vllm_config).key_smoothing
    if mode == "off":
        logger.info("TurboQuant key smoothing: off (--tq-key-smoothing off)")
        return
    from ..integrations.key_smoothing import apply_key_smoothing_fused

    # LoRA adapters on qkv_proj would not see a scale folded into its rows: with LoRA only the norm gains take it.
    fold_rows = mode == "all" and getattr(vllm_config, "lora_config", None) is None
    summary = apply_key_smoothing_fused(model, fold_qkv_rows=fold_rows, tp=_tensor_parallel_heads())
    logger.info("TurboQuant key smoothing (%s): %s", mode, summary.describe())


def _tensor_parallel_heads():
    """This rank in vLLM's tensor-parallel group, when there is more than one rank."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return None
    from ..integrations.key_smoothing import TensorParallelHeads

    return TensorParallelHeads(group.rank_in_group, group.world_size, group.device_group)
