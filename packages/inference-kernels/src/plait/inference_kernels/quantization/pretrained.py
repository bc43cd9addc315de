"""Rebuild a weight-only quantized HF model from compressed-tensors ``pack-quantized`` safetensors.

``plait ckpt convert QUANTIZED DST --to hf`` writes that layout (see
``plait.universal_ckpt.interop.hf_quantized``); vLLM serves it, and transformers reads it when
the compressed-tensors package is installed. :func:`load_quantized_pretrained` needs neither: it
builds the model from its config, quantizes it with :func:`plait.inference_kernels.quantization.quantize`
(the same Linears, kept ones from the ``ignore`` list) and loads the stored codes, scales and zero
points into the quantized modules, so the model computes exactly what plait's in-memory
quantization of the same weights computes. It reads every pack-quantized checkpoint whose scheme
plait's formats hold: int8 per channel (symmetric), int4 group 32/64/128, symmetric or not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from plait.inference_kernels.quantization.apply import QuantizeConfig, quantize
from plait.inference_kernels.quantization.modules import check_cpu_kernel
from plait.kernels.ops.quant_matmul import INT4_GROUP_SIZES, unpack_int4


def config_from_json(quant: dict) -> QuantizeConfig:
    """The :class:`QuantizeConfig` a compressed-tensors ``quantization_config`` stands for.

    Raises:
        ValueError: a format, group or scheme plait's formats do not hold (naming the field).
    """
    if quant.get("quant_method") != "compressed-tensors" or quant.get("format") != "pack-quantized":
        raise ValueError(f"quantization_config quant_method={quant.get('quant_method')!r} "
                         f"format={quant.get('format')!r}: only compressed-tensors pack-quantized is read here.")
    groups = list(quant.get("config_groups", {}).values())
    if len(groups) != 1 or groups[0].get("input_activations") or groups[0].get("targets") != ["Linear"]:
        raise ValueError("quantization_config.config_groups must be one weight-only group targeting Linear.")
    w = groups[0]["weights"]
    if w.get("type") != "int" or w.get("actorder"):
        raise ValueError(f"quantization_config weights type={w.get('type')!r} actorder={w.get('actorder')!r}: "
                         "only int weights without activation ordering are read here.")
    if w.get("num_bits") == 8 and w.get("strategy") == "channel" and w.get("symmetric"):
        return QuantizeConfig(kind="int8", keep_original=False)
    if w.get("num_bits") == 4 and w.get("strategy") == "group" and w.get("group_size") in INT4_GROUP_SIZES:
        return QuantizeConfig(kind="int4", group_size=w["group_size"], symmetric=bool(w.get("symmetric")),
                              keep_original=False)
    raise ValueError(f"quantization_config weights num_bits={w.get('num_bits')} strategy={w.get('strategy')!r} "
                     f"group_size={w.get('group_size')} symmetric={w.get('symmetric')}: plait reads int8 channel "
                     f"(symmetric) and int4 group {'/'.join(map(str, INT4_GROUP_SIZES))}.")


def unpack_zero_points(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[ceil(N / 8), G]`` (eight 4-bit values along dim 0) -> uint8 ``[N, G]``."""
    by_group = packed.T.contiguous().view(torch.uint8)  # [G, ceil(N/8) * 4] bytes, little-endian words
    return unpack_int4(by_group)[:, :n].T.contiguous()


def _translate(tensors: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Names and dtypes of the pack-quantized layout -> QuantizedLinear's buffers."""
    out = {}
    for name, t in tensors.items():
        stem, _, suffix = name.rpartition(".")
        if suffix == "weight_packed":
            codes = t.contiguous().view(torch.uint8)
            out[f"{stem}.weight_codes"] = (codes.to(torch.int16) - 128).to(torch.int8) if kind == "int8" else codes
        elif suffix == "weight_scale":
            out[f"{stem}.weight_scales"] = t.to(torch.float32)
        elif suffix == "weight_zero_point":
            n = int(tensors[f"{stem}.weight_shape"][0])
            out[f"{stem}.weight_zeros"] = unpack_zero_points(t, n)
        elif suffix != "weight_shape":
            out[name] = t
    return out


def load_quantized_pretrained(path: str | os.PathLike, *, cpu_kernels: bool = True,
                              cpu_bf16_decode: bool = False, cpu_kernel: str = "torch") -> nn.Module:
    """A transformers causal LM with plait's quantized Linears, from a pack-quantized directory.

    Args:
        path: a directory with config.json (holding the compressed-tensors ``quantization_config``)
            and ``*.safetensors``.
        cpu_kernels, cpu_bf16_decode, cpu_kernel: as :class:`QuantizeConfig` (``cpu_kernel="plait"``
            runs plait's own AVX2 CPU kernels; refused before any file is read where they cannot
            be built here).

    Returns:
        The model in eval mode, quantized (:func:`plait.inference_kernels.quantization.revert`
        turns its modules into Linears holding the dequantized weights).

    Raises:
        ValueError: ``cpu_kernel`` unknown or not available here (named); no quantization_config,
            or one plait does not read (named); a tensor missing from or unknown to the model (named
            by ``load_state_dict``).
    """
    import transformers
    from safetensors.torch import load_file

    check_cpu_kernel(cpu_kernel, field="load_quantized_pretrained(cpu_kernel)")
    path = Path(path)
    body = json.loads((path / "config.json").read_text())
    if "quantization_config" not in body:
        raise ValueError(f"{path}/config.json has no quantization_config; load it with from_pretrained instead.")
    quant = body["quantization_config"]
    base = config_from_json(quant)
    hf_config = transformers.AutoConfig.from_pretrained(path)
    del hf_config.quantization_config  # built plain, quantized by plait below
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    head = model.get_output_embeddings()
    ignored = set(quant.get("ignore", ()))
    skip = tuple(name for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and name in ignored and m is not head)
    config = QuantizeConfig(kind=base.kind, group_size=base.group_size, symmetric=base.symmetric,
                            head=head is not None and not any(n in ignored for n, m in model.named_modules()
                                                              if m is head),
                            skip=skip, keep_original=False, cpu_kernels=cpu_kernels, cpu_bf16_decode=cpu_bf16_decode,
                            cpu_kernel=cpu_kernel,
                            experts=False)  # pack-quantized targets Linears: fused experts stay as stored
    quantize(model, config)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    model.load_state_dict(_translate(state, base.kind), strict=True)
    return model
