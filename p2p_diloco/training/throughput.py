"""Throughput you can see: FLOPs per token of the model, the device's peak, and the model FLOPs utilisation (MFU).

MFU = achieved model FLOPs per second / the device's peak (PaLM, Chowdhery et al. 2022, https://arxiv.org/abs/
2204.02311, appendix B): a training token costs ``6 N`` FLOPs in its matmuls (forward 2N, backward 4N) plus
``12 L d T`` in attention's score and value products (L layers, model width d, sequence length T). N counts the
parameters that multiply activations: every parameter but the input embedding table (a lookup, not a matmul; a
tied output head is counted once, as the head). Recomputation (activation checkpointing) is not counted: MFU
measures the model's FLOPs, not the hardware's.

The peak is the dense bf16 tensor-core figure of the vendor's datasheet for common data-centre GPUs, or
``train.peak_tflops`` when set (any device, a CPU included); with neither, MFU is not reported rather than made up.
"""

from __future__ import annotations

import torch

# dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from the vendors' datasheets; matched against
# torch.cuda.get_device_name() in this order (the first name that occurs in it wins)
PEAK_BF16_TFLOPS = (
    ("H200", 989.5), ("H100 PCIe", 756.0), ("H100", 989.5), ("GH200", 989.5), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0),
)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of ``model`` (module docstring): ``6 N + 12 L d T``."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = output is not None and any(id(p) in skip for p in output.parameters())
    n = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    if tied:  # the shared table is the output head's matmul too
        n += sum(p.numel() for p in output.parameters())
    cfg = getattr(model, "config", None)
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    width = getattr(cfg, "hidden_size", 0) or 0
    return 6.0 * n + 12.0 * layers * width * seq_len


def peak_flops(device: torch.device, setting_tflops: float = 0.0) -> float | None:
    """The device's peak in FLOP/s: ``setting_tflops`` (``train.peak_tflops``) if > 0, else a known CUDA GPU's
    dense bf16 peak, else None (unknown: no MFU)."""
    if setting_tflops > 0:
        return setting_tflops * 1e12
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def mfu(tokens_per_s: float, per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation (0..1), or None when the peak is unknown."""
    if not peak or tokens_per_s <= 0:
        return None
    return tokens_per_s * per_token / peak
