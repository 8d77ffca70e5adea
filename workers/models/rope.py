"""YaRN rope scaling and the interleaved (GPT-J) rotation, as transformers computes them.

`yarn_parameters` ports transformers' `_compute_yarn_parameters` step by step (float32
frequencies, python-float correction range, the 0.001 nudge when the ramp collapses), so
that its inverse frequencies are bit-identical to transformers'. It serves the dense
decoders (Llama/Qwen `rope_scaling` type yarn, NeoX rotation) and DeepSeek-V3 / Kimi-K2,
whose MLA also scales its softmax by `mla_softmax_scale`.

DeepSeek lays its rope dimensions out in interleaved pairs (x0, x1), (x2, x3), ...: each pair
turns by one frequency. `apply_rotary_interleaved` rotates them and returns the result
de-interleaved (the even members first, then the odd ones), exactly as transformers'
`apply_rotary_pos_emb_interleave`. The layout of the output does not matter to attention as
long as q and k share it, which they do: both go through this function.
"""

from __future__ import annotations

import math

import torch

from specd.workers.models.config import RopeScaling


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 1 for scale <= 1, else 0.1 * mscale * ln(scale) + 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(head_dim: int, theta: float, s: RopeScaling, device: torch.device
                    ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [head_dim / 2], cos/sin scaling): transformers'
    `_compute_yarn_parameters` for a rope over `head_dim` dimensions.

    The frequencies blend interpolated (divided by `factor`) and original ones with a
    linear ramp between the correction dimensions that beta_fast and beta_slow give on
    `original_max_position_embeddings`. The cos/sin scaling is `attention_factor` when the
    config sets it, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
    are set (non-zero), else mscale(factor).
    """
    factor = s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, s.mscale)
                                     / yarn_get_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    low, high = _correction_range(s.beta_fast, s.beta_slow, head_dim, theta,
                                  s.original_max_position_embeddings, s.truncate)
    # Every tensor on `device` explicitly: the model is built under torch.device("meta").
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    pos_freqs = theta ** (exponents / head_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation = 1 - _linear_ramp(low, high, head_dim // 2, device)
    inv_freq = (inv_freq_interpolation * (1 - extrapolation)
                + inv_freq_extrapolation * extrapolation)
    return inv_freq, attention_factor


def mla_softmax_scale(qk_head_dim: int, scaling: RopeScaling | None) -> float:
    """MLA's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under
    YaRN with a (non-zero) mscale_all_dim (transformers' `yarn_apply_mscale`). The same
    scale serves the expanded and the absorbed path (not (kv_lora_rank + rope)^-0.5)."""
    scale = qk_head_dim ** -0.5
    if scaling is not None and scaling.mscale_all_dim:
        mscale = yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                             ) -> torch.Tensor:
    """x [N, heads, d] with interleaved pairs (2i, 2i + 1), rotated by (cos, sin) [N, 1,
    d / 2] -> [N, heads, d] de-interleaved: [x_even * cos - x_odd * sin, x_odd * cos +
    x_even * sin] (transformers' `apply_rotary_pos_emb_interleave`)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _correction_range(beta_fast: float, beta_slow: float, dim: int, theta: float,
                      original_max: int, truncate: bool) -> tuple[float, float]:
    """The dimensions where the ramp from extrapolation to interpolation starts and ends."""
    low = _correction_dim(beta_fast, dim, theta, original_max)
    high = _correction_dim(beta_slow, dim, theta, original_max)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _correction_dim(num_rotations: float, dim: int, theta: float, original_max: int) -> float:
    """The dimension whose wavelength makes `num_rotations` turns over `original_max`."""
    return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))


def _linear_ramp(low: float, high: float, dim: int, device: torch.device) -> torch.Tensor:
    """float32 [dim]: 0 up to `low`, 1 from `high`, linear between (transformers nudges
    `high` by 0.001 when the two meet, e.g. Kimi's beta_fast == beta_slow)."""
    if low == high:
        high += 0.001
    ramp = (torch.arange(dim, dtype=torch.float32, device=device) - low) / (high - low)
    return torch.clamp(ramp, 0, 1)
