"""LoRAManager: the adapters a runner serves, by name.

An adapter is *registered* (a name and a path: `--lora-paths`, `/load_lora_adapter`), *resident* (its pairs read and
attached to the model's linear layers under a slot number, which batches name) and *held* (by the running requests
that use it). Resident adapters stay within a memory budget: making one resident evicts the least recently used
adapters that no request holds (they stay registered and are read again when next asked for). Unregistering an
adapter that requests hold refuses new requests at once and frees it when the last one finishes.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from plait.runtime.lora.adapter import MODULES, PROJECTIONS, LoRAAdapter, read_adapter

logger = logging.getLogger(__name__)


@dataclass
class Resident:
    slot: int  # the number batches name it by; a new one each time it becomes resident (the cache's namespace too)
    nbytes: int


class LoRAManager:
    def __init__(self, model: nn.Module, budget_bytes: int):
        self.model = model
        self.budget = budget_bytes
        self.paths: dict[str, str] = {}  # registered
        self.resident: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self.holds: dict[str, int] = {}
        self.leaving: set[str] = set()  # unregistered while held: freed when the last request ends
        self._next_slot = 0
        cfg = model.cfg
        self._heads = (cfg.num_heads, cfg.num_kv_heads)

    # ---- registration -------------------------------------------------------------
    def register(self, name: str, path: str) -> Resident:
        """Read, check and attach the adapter (ValueError: why not; nothing changes then)."""
        if not name or not isinstance(name, str) or ":" in name or len(name) > 128:
            raise ValueError(f"LoRA adapter name {name!r} must be 1-128 characters without ':'")
        if name in self.paths:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")
        self.paths[name] = path
        try:
            return self._make_resident(name)
        except BaseException:
            del self.paths[name]
            raise

    def unregister(self, name: str) -> None:
        if name not in self.paths:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        del self.paths[name]
        if self.holds.get(name):
            self.leaving.add(name)  # its running requests finish with it
        elif name in self.resident:
            self._detach(name)

    def names(self) -> list[str]:
        return sorted(self.paths)

    # ---- requests -----------------------------------------------------------------
    def acquire(self, name: str) -> Resident:
        """The adapter for a new request, made resident if it is not (ValueError: unknown, or it cannot fit)."""
        if name not in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {self.names()})")
        res = self.resident.get(name) or self._make_resident(name)
        self.resident.move_to_end(name)
        self.holds[name] = self.holds.get(name, 0) + 1
        return res

    def release(self, name: str) -> None:
        self.holds[name] -= 1
        if not self.holds[name]:
            del self.holds[name]
            if name in self.leaving:
                self.leaving.discard(name)
                self._detach(name)

    @property
    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self.resident.values())

    def stats(self) -> dict:
        return {"lora_adapters": self.names(), "lora_resident": list(self.resident),
                "lora_resident_bytes": self.resident_bytes}

    # ---- residency ----------------------------------------------------------------
    def _make_resident(self, name: str) -> Resident:
        adapter = read_adapter(name, self.paths[name], self._heads)
        per_linear = self._per_linear(adapter)
        need = sum((a.numel() + bt.numel()) * a.element_size() for parts in per_linear.values() for _, a, bt in parts)
        if need > self.budget:
            raise ValueError(f"LoRA adapter {name!r} needs {need / 2**20:.1f} MiB, more than the LoRA memory budget "
                             f"of {self.budget / 2**20:.0f} MiB (--lora-memory-mb)")
        for other in [n for n in self.resident if not self.holds.get(n)]:
            if self.resident_bytes + need <= self.budget:
                break
            logger.info("LoRA adapter %s evicted (least recently used; read again when asked for)", other)
            self._detach(other)
        if self.resident_bytes + need > self.budget:
            raise ValueError(f"LoRA adapter {name!r} does not fit the LoRA memory budget beside the adapters running "
                             f"requests hold ({self.resident_bytes / 2**20:.1f} of {self.budget / 2**20:.0f} MiB)")
        slot = self._next_slot
        self._next_slot += 1
        for linear, parts in per_linear.items():
            linear.lora[slot] = parts
        res = Resident(slot, need)
        self.resident[name] = res
        logger.info("LoRA adapter %s resident: rank %d, %s, %.1f MiB", name, adapter.rank, ",".join(adapter.modules),
                    need / 2**20)
        return res

    def _detach(self, name: str) -> None:
        res = self.resident.pop(name)
        for layer in self.model.layers:
            for linear in _linears(layer):
                linear.lora.pop(res.slot, None)

    def _per_linear(self, adapter: LoRAAdapter) -> dict[nn.Module, list[tuple[int, torch.Tensor, torch.Tensor]]]:
        """Each targeted linear layer's shards, in output order: (their first output row, A [r, in],
        (scaling * B)^T [r, rows]; kernels add B^T's rows to a row's outputs), checked against the layer's shapes."""
        layers = self.model.layers
        out: dict[nn.Module, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for (i, module), (a, b) in adapter.pairs.items():
            if i >= len(layers):
                raise ValueError(f"LoRA adapter {adapter.name!r} has layer {i}; the model has {len(layers)}")
            attr, shard = MODULES[module]
            linear = getattr(layers[i], attr, None)
            if linear is None:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {i} has no {module} (a mixture-of-experts "
                                 "layer's MLP takes no adapter)")
            if linear.keep_rows or linear.keep_cols is not None:
                raise ValueError("LoRA adapters need the model whole on one rank (no tensor parallelism)")
            start, size = linear.shard_rows[shard] if shard else (0, linear.out_features)
            if a.shape[1] != linear.in_features or b.shape[0] != size:
                raise ValueError(f"LoRA adapter {adapter.name!r}: {module} pair A {tuple(a.shape)}, B "
                                 f"{tuple(b.shape)} does not fit the model's {module} ({size} x {linear.in_features}): "
                                 "an adapter of another base model?")
            out.setdefault(linear, []).append((start, a, b.t().contiguous()))
        return {linear: sorted(parts, key=lambda p: p[0]) for linear, parts in out.items()}


def _linears(layer: nn.Module) -> list[nn.Module]:
    return [m for m in (getattr(layer, attr, None) for attr in PROJECTIONS) if m is not None]


def lora_paths(items) -> list[tuple[str, str]]:
    """--lora-paths' items as (name, path): `name=path`, or a bare path named after its folder or file."""
    out = []
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep:
            path = item
            name = os.path.splitext(os.path.basename(item.rstrip("/")))[0]
        out.append((name, path))
    return out
