"""A LoRA adapter read from disk, as per-layer low-rank pairs keyed by the base model's module names.

Two formats:
- PEFT's folder: `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`, `rank_pattern`,
  `alpha_pattern`) and `adapter_model.safetensors` (`base_model.model.model.layers.{i}.{attn|mlp}.{m}.lora_A.weight`
  [r, in] and `lora_B.weight` [out, r]);
- llama.cpp's GGUF LoRA (`convert_lora_to_gguf.py`, `--lora`): `general.type = adapter`, `adapter.type = lora`,
  `adapter.lora.alpha`, tensors `blk.{i}.{attn_q|...}.weight.lora_a` [r, in] and `.lora_b` [out, r].

What a layer adds is `scaling * B (A x)`: scaling is alpha / r (alpha / sqrt(r) with rsLoRA) and is folded into B
here. What plait cannot apply is refused when the adapter is read, naming it: DoRA, trained biases, fully trained
modules (`modules_to_save`), targets other than the attention and MLP projections.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# a decoder layer's linear layers that take adapters, in the C decode stack's table order (kernels/cpu_decode.py)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# the projections an adapter may target: PEFT's module name -> (plait's layer, its shard)
MODULES = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "o_proj": ("o_proj", ""), "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
           "down_proj": ("down_proj", "")}
# llama.cpp's tensor names of the same projections
_GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_PEFT_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_GGUF_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


@dataclass
class LoRAAdapter:
    """Low-rank pairs (A [r, in], scaling * B [out, r], float32) per (layer, PEFT module name)."""

    name: str
    path: str
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.pairs.values())

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.pairs})



def read_adapter(name: str, path: str, heads: tuple[int, int] = (0, 0)) -> LoRAAdapter:
    """The adapter at `path` (a PEFT folder, or a GGUF LoRA file); ValueError names what is wrong with it. `heads`:
    the base model's query and KV heads (a GGUF file's q/k rows are permuted as llama.cpp permutes its models')."""
    if os.path.isdir(path):
        return _read_peft(name, path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return _read_gguf(name, path, heads)
    raise ValueError(f"LoRA adapter {name!r}: {path!r} is neither a PEFT folder (adapter_config.json + "
                     "adapter_model.safetensors) nor a GGUF LoRA file")


def _read_peft(name: str, path: str) -> LoRAAdapter:
    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(config_file) or not os.path.isfile(weights_file):
        raise ValueError(f"LoRA adapter {name!r}: {path} needs adapter_config.json and adapter_model.safetensors")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json does not read: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = [(key, config.get(key)) for key, ok in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False))
               if config.get(key, ok) != ok]
    if config.get("modules_to_save"):
        refused.append(("modules_to_save", config["modules_to_save"]))
    if refused:
        raise ValueError(f"LoRA adapter {name!r}: {', '.join(f'{k}={v!r}' for k, v in refused)} is not supported "
                         "(plain LoRA on the attention and MLP projections only)")
    alpha, rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora", False))
    alpha_pattern = config.get("alpha_pattern") or {}
    from safetensors import safe_open

    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_file, framework="pt") as f:
            for key in f.keys():
                m = _PEFT_NAME.match(key)
                if m is None:
                    raise ValueError(f"tensor {key} is not a LoRA pair of a layer's projection")
                layer, module, which = int(m.group(1)), m.group(2), m.group(3)
                raw.setdefault((layer, module), {})[which] = f.get_tensor(key).float()
    except ValueError as e:
        raise ValueError(f"LoRA adapter {name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged file: say so, whatever safetensors raised
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors does not read: {e}") from None

    def scale(layer: int, module: str, rank: int) -> float:
        a = next((v for k, v in alpha_pattern.items() if f"layers.{layer}.{module}".endswith(k) or k == module), alpha)
        return a / math.sqrt(rank) if rslora else a / rank

    return LoRAAdapter(name, path, _pairs(name, raw, scale))


def _read_gguf(name: str, path: str, heads: tuple[int, int]) -> LoRAAdapter:
    from plait.runtime.model_loader.gguf_arch import needs_unpermute, unpermute_qk
    from plait.runtime.model_loader.gguf_file import GGUFFile
    from plait.runtime.model_loader.sources import float_tensor

    try:
        file = GGUFFile(path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"LoRA adapter {name!r}: {path} does not read as GGUF: {e}") from None
    meta = file.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ValueError(f"LoRA adapter {name!r}: {path} is a GGUF file but not a LoRA adapter "
                         f"(general.type {meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r})")
    alpha = float(meta.get("adapter.lora.alpha", 0) or 0)
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for info in file.tensors:
        m = _GGUF_NAME.match(info.name)
        if m is None or m.group(2) not in _GGUF_MODULES:
            raise ValueError(f"LoRA adapter {name!r}: tensor {info.name} is not a LoRA pair of a layer's projection")
        layer, module, which = int(m.group(1)), _GGUF_MODULES[m.group(2)], m.group(3).upper()
        tensor = float_tensor(file.data(info), info)
        if which == "B" and needs_unpermute(file.architecture, f"{module}.weight"):  # B's rows are q's or k's rows
            tensor = unpermute_qk(tensor, heads[0] if module == "q_proj" else heads[1])
        raw.setdefault((layer, module), {})[which] = tensor
    # llama.cpp: scale = alpha / rank, or 1 when the file gives no alpha
    return LoRAAdapter(name, path, _pairs(name, raw, lambda layer, module, rank: alpha / rank if alpha else 1.0))


def _pairs(name: str, raw: dict[tuple[int, str], dict[str, torch.Tensor]], scale
           ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    if not raw:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA pairs")
    unknown = sorted({m for _, m in raw} - set(MODULES))
    if unknown:
        raise ValueError(f"LoRA adapter {name!r} targets {unknown}: plait applies adapters to {sorted(MODULES)}")
    pairs = {}
    for (layer, module), ab in sorted(raw.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lacks its lora_{'AB'[('A' in ab)]}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module}: A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)} are not a rank-r pair")
        pairs[(layer, module)] = (a.contiguous(), (b * scale(layer, module, a.shape[0])).contiguous())
    return pairs
