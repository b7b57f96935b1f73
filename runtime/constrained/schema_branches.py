"""oneOf branches told apart: a `oneOf` is an `anyOf` where no instance can be valid for two branches
(disjoint types, pinned values, required names one forbids, discriminators), else narrowed until each branch
excludes the others as sent, else refused naming the pair; and the set logic over subschemas this needs."""

from __future__ import annotations

import copy
import json
from typing import Any

from plait.runtime.constrained.schema_keywords import (ASSERTING, JSON_TYPES, MAX_BRANCH_PAIRS,
                                                       NOT_MERGED_INTO_BRANCHES, conjunction, lookup,
                                                       make_impossible, pinned_values, type_of)


class Branches:
    """Methods of the schema walker (schema_policy._Walker), which holds the state they share."""

    def one_of(self, s: dict, ptr: str) -> None:
        """`oneOf` as `anyOf` where no instance can be in two branches. With narrowing, the branches
        narrowed to exclude one another (closed, told apart by required names or a discriminator), and
        those that still overlap another dropped: each kept branch excludes every other as sent."""
        branches = s.pop("oneOf")
        if not isinstance(branches, list):
            self.bad(f"{ptr}/oneOf", "'oneOf' that is not a list")
            return
        if len(branches) == 1 and not s.get("anyOf"):  # exactly one of one
            s["anyOf"] = branches
            return
        sent, root = self.sent_branches(s, ptr, branches)
        chosen = None
        # each branch with what stands beside the oneOf merged in (a discriminator the parent requires,
        # its type): an instance of the parent has them, so they tell branches apart too
        siblings = {k: v for k, v in s.items() if k in ASSERTING and k not in NOT_MERGED_INTO_BRANCHES}
        branches = [self.flattened(b, siblings, None) for b in branches]
        if sent is not None:
            sent = [self.flattened(b, siblings, root) for b in sent]
        if sent is not None:
            candidates = [branches]
            if self.narrow:
                candidates += [n for n in (
                    [self.closed_object(b) for b in branches], self.exclusive(branches, s),
                    self.discriminated(branches), self.without_pinned(branches), self.typed_apart(branches))
                    if n is not None]
            best = []
            for candidate in candidates:
                kept = self.exclusive_of_others(candidate, sent, root)
                if len(kept) == len(branches) or (self.narrow and len(kept) > len(best)):
                    best = kept
                if len(best) == len(branches):
                    break
            if best:
                chosen = [b for _, b in best]
                if len(best) < len(branches) or any(b is not branches[i] for i, b in best):
                    self.narrower = True
                    self.narrowed.append(f"oneOf at {ptr}: its branches narrowed to exclude one another"
                                         + (f", {len(branches) - len(best)} of {len(branches)} left out"
                                            if len(best) < len(branches) else ""))
        if chosen is None:
            pair = self.overlapping_pair(branches, sent, root)
            self.bad(f"{ptr}/oneOf", "'oneOf' whose branches may overlap (exactly-one cannot be enforced"
                     + (f": branches {pair[0]} and {pair[1]} may both match" if pair else "") + ")")
        elif s.get("anyOf"):
            # (A1 or A2) and exactly one of (B1, B2), whose branches now exclude one another: every pair (exact),
            # less those no instance satisfies
            pairs = [conjunction(a, b) for a in s["anyOf"] for b in chosen if not self.pair_disjoint(a, b)]
            if len(pairs) > MAX_BRANCH_PAIRS:
                self.bad(f"{ptr}/oneOf", f"'oneOf' beside 'anyOf' ({len(pairs)} pairs of branches, over {MAX_BRANCH_PAIRS})")
            elif not pairs:
                make_impossible(s)
            else:
                s["anyOf"] = pairs
        else:
            s["anyOf"] = chosen

    def flattened(self, branch: Any, siblings: dict, root: Any) -> Any:
        """`branch` and `siblings` as one schema, where the allOf merge is exact (else `branch`); the
        branch's references resolve in `root` (None: the schema being rewritten)."""
        b = self.deref(branch, root)
        if not isinstance(b, dict) or not (siblings or isinstance(b.get("allOf"), list)):
            return branch
        trial = copy.copy(self)  # shares the schemas; its own findings, and no narrowing
        trial.problems, trial.narrowed, trial.origins, trial.narrow = [], [], {}, False
        trial.root = self.root if root is None else root
        merged = {**copy.deepcopy(siblings), "allOf": [copy.deepcopy(b)]}
        trial.merge_all_of(merged, "#")
        return branch if trial.problems or "allOf" in merged or trial.impossible(merged) else merged

    def overlapping_pair(self, branches: list, sent: list | None, root: Any) -> tuple[int, int] | None:
        """The first two branches no check tells apart (for the refusal's message)."""
        others = sent if sent is not None else branches
        return next(((i, j) for i in range(len(branches)) for j in range(i + 1, len(others))
                     if not self.pair_disjoint(branches[i], others[j], rb=root)), None)

    def without_pinned(self, branches: list) -> list | None:
        """Each branch less the values the other branches pin (`{"enum": ["linux"]}` beside `{"type":
        "string"}`), through `not`'s narrowing (longer strings, larger numbers). None where no other
        branch pins values."""
        pins = [self.pinned(b) for b in branches]
        if all(p is None for p in pins):
            return None
        out = []
        for i, branch in enumerate(branches):
            banned = sorted(set().union(*(p for j, p in enumerate(pins) if j != i and p is not None)))
            b = self.deref(branch)
            if not banned or not isinstance(b, dict) or "not" in b:
                out.append(branch)
                continue
            b = {**copy.deepcopy(b), "not": {"enum": [json.loads(v) for v in banned]}}
            self.narrow_not(b)
            out.append(branch if "not" in b else b)
        return out

    def typed_apart(self, branches: list) -> list | None:
        """Each branch less the JSON types another branch admits (a branch of anything, such as ajv's
        `{"typeof": "function"}`, beside `{"type": "string"}`: exactly one holds only for the types the others
        leave); a branch left no type admits nothing. None where no two branches share a type."""
        types = [self.types(b) for b in branches]
        if sum(len(t) for t in types) == len(set().union(*types)):
            return None
        out, numbers = [], {"integer", "number"}
        for i, branch in enumerate(branches):
            # numbers stay: an integer branch beside a number branch is not told apart by type (1.5 is a number only)
            mine = types[i] - (set().union(*(t for j, t in enumerate(types) if j != i)) - numbers)
            b = self.deref(branch)
            if mine == types[i] or not isinstance(b, dict):
                out.append(branch)
            elif not mine:
                out.append(False)
            else:
                out.append({**copy.deepcopy(b), "type": sorted(mine - {"integer"} if "number" in mine else mine)})
        return out

    def exclusive_of_others(self, candidate: list, sent: list, root: Any) -> list[tuple[int, Any]]:
        """(index, branch) of the candidate branches that admit nothing another branch as sent admits."""
        return [(i, b) for i, b in enumerate(candidate) if b is not False
                and all(self.pair_disjoint(b, sent[j], rb=root) for j in range(len(sent)) if j != i)]

    def sent_branches(self, s: dict, ptr: str, branches: list) -> tuple[list | None, Any]:
        """This oneOf's branches as sent, and the schema to resolve them in: the walk rewrites in place,
        and a definition it has narrowed elsewhere no longer says what the sender's branch admits.
        (None, None) where they cannot be found as sent."""
        merged_from = self.origins.get(id(s), (None, None))[1]
        for where in (ptr, merged_from):  # here, or the allOf part it was merged from
            node = lookup(self.original, where) if where else None
            found = node.get("oneOf") if isinstance(node, dict) else None
            if isinstance(found, list) and len(found) == len(branches):
                return found, self.original
        if not self.narrower:
            return branches, None  # nothing narrowed yet: as sent
        # a copy (a parent oneOf's branch with its siblings merged in): the same branches, written the same way,
        # as the sender wrote them somewhere (so they mean there what they meant as sent)
        same = self.sent_one_ofs().get(json.dumps(branches, sort_keys=True))
        return (same, self.original) if same is not None else (None, None)

    def sent_one_ofs(self) -> dict[str, list]:
        """Every oneOf of the schema as sent, by its text."""
        if self.one_ofs is None:
            self.one_ofs, stack = {}, [self.original]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    if isinstance(node.get("oneOf"), list):
                        self.one_ofs.setdefault(json.dumps(node["oneOf"], sort_keys=True), node["oneOf"])
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
        return self.one_ofs

    # ---- oneOf disjointness -----------------------------------------------------------------
    # Disjointness is judged between a branch as it will be enforced (rewritten, maybe narrowed: root
    # None) and the others as sent (root self.original): a narrowed branch must still exclude the
    # others' every instance, not only their narrowed ones.
    def deref(self, s: Any, root: Any = None) -> Any:
        for _ in range(16):
            if isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
                nxt = self.resolve(s["$ref"], "#", root)
                if nxt is None:
                    return s
                s = nxt
            else:
                break
        return s

    def types(self, s: Any, root: Any = None) -> set[str]:
        s = self.deref(s, root)
        if not isinstance(s, dict):
            return set(JSON_TYPES) if s is not False else set()
        if "const" in s:
            return {type_of(s["const"])}
        if isinstance(s.get("enum"), list):
            return {type_of(v) for v in s["enum"]}
        t = s.get("type")
        if isinstance(t, str):
            out = {t}
        elif isinstance(t, list):
            out = set(t)
        elif "anyOf" in s or "oneOf" in s:
            out = set().union(*(self.types(b, root) for b in (s.get("anyOf") or s.get("oneOf") or [])))
        else:
            out = set(JSON_TYPES)
        if "integer" in out or "number" in out:  # 1 is both an integer and a number
            out |= {"integer", "number"}
        return out

    def pair_disjoint(self, a: Any, b: Any, depth: int = 0, ra: Any = None, rb: Any = None) -> bool:
        """No instance is valid for both (a resolved in `ra`, b in `rb`: None the rewritten schema)."""
        a, b = self.flattened(a, {}, ra), self.flattened(b, {}, rb)  # an allOf as one schema, where it merges
        a, b = self.deref(a, ra), self.deref(b, rb)
        if a is False or b is False:
            return True
        if not self.types(a, ra) & self.types(b, rb):
            return True
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        pins = self.pinned(a), self.pinned(b)
        if None not in pins and not (_values(pins[0]) & _values(pins[1])):
            return True  # both pin values, none in common (a discriminator's consts: no validator needed)
        for x, y in ((a, b), (b, a)):  # the values one pins, each checked against the other
            values = self.pinned(x)
            if values is not None and not any(self.admits(y, json.loads(v)) for v in values):
                return True
        if depth >= 4:  # recursive schemas: stop looking
            return False
        for x, rx, y, ry in ((a, ra, b, rb), (b, rb, a, ra)):  # every instance of x is in one of its branches
            branches = x.get("anyOf") or x.get("oneOf")
            if isinstance(branches, list) and branches and len(branches) <= 64 and all(
                    self.pair_disjoint(branch, y, depth + 1, rx, ry) for branch in branches):
                return True
        # the rules below look at objects' properties (arrays' items): they hold where that is all both admit
        common = self.types(a, ra) & self.types(b, rb)
        for x, y in ((a, b), (b, a)):  # x's instances have more properties (items) than y's may
            needs = max(len(set(x.get("required") or [])), _count(x, "minProperties"))
            if (common <= {"object"} and needs > _count(y, "maxProperties", needs)) or (
                    common <= {"array"} and _count(x, "minItems") > _count(y, "maxItems", 1 << 62)) or (
                    common <= {"string"} and _count(x, "minLength") > _count(y, "maxLength", 1 << 62)):
                return True
            if common <= {"integer", "number"} and _above(x, y):
                return True
        for x, rx, y, ry in ((a, ra, b, rb), (b, rb, a, ra)):
            for key in (x.get("required") or []) if common <= {"object"} else []:
                xp, yp = (x.get("properties") or {}).get(key), (y.get("properties") or {}).get(key)
                if yp is None and not y.get("patternProperties") and isinstance(y.get("additionalProperties"), dict):
                    yp = y["additionalProperties"]  # what y allows of a name it does not list
                # x has the name, and where y's instance has it, y gives it values x's cannot take
                if xp is not None and yp is not None and self.pair_disjoint(xp, yp, depth + 1, rx, ry):
                    return True
                if (y.get("additionalProperties") is False and key not in (y.get("properties") or {})
                        and not y.get("patternProperties")) or (y.get("properties") or {}).get(key) is False:
                    return True
        if self.types(a, ra) == self.types(b, rb) == {"array"} \
                and min(a.get("minItems", 0), b.get("minItems", 0)) >= 1 \
                and isinstance(a.get("items"), dict) and isinstance(b.get("items"), dict) \
                and not a.get("prefixItems") and not b.get("prefixItems"):
            return self.pair_disjoint(a["items"], b["items"], depth + 1, ra, rb)  # their first items differ
        return False

    def admits(self, sub: Any, value: Any) -> bool:
        """Whether jsonschema finds `value` valid for `sub` (references resolved in the schema as sent:
        the walk rewrites the one it is given). True when it cannot tell. One validator serves the walk (its
        registry of the definitions is most of a validator's cost), and the answers for the schema as sent,
        which the walk never changes, are remembered."""
        key = (id(sub), json.dumps(value, sort_keys=True)) if id(sub) in self.sent_ids() else None
        if key is not None and key in self.admitted:
            return self.admitted[key]
        try:
            ok = next(self.validator().descend(value, sub), None) is None
        except Exception:  # noqa: BLE001 - an unresolvable reference, a bad pattern: assume it admits
            ok = True
        if key is not None:
            self.admitted[key] = ok
        return ok

    def validator(self):
        if self.checker is None:
            import jsonschema

            root = self.original if isinstance(self.original, dict) else {}
            probe = {k: v for k, v in root.items() if k in ("definitions", "$defs")}
            cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
            self.checker = cls(probe, format_checker=cls.FORMAT_CHECKER)
        return self.checker

    def sent_ids(self) -> set[int]:
        """The ids of the schema as sent's every node (it outlives the walk, so they stay unique)."""
        if self.original_ids is None:
            self.original_ids, stack = set(), [self.original]
            while stack:
                node = stack.pop()
                if isinstance(node, (dict, list)):
                    self.original_ids.add(id(node))
                    stack.extend(node.values() if isinstance(node, dict) else node)
        return self.original_ids

    def discriminated(self, branches: list) -> list | None:
        """Object branches that pin one property to values no other branch allows (or give it schemas no
        value of which two share), each narrowed to require it (absent, it would leave every branch open).
        None where no property does."""
        resolved = [self.deref(b) for b in branches]
        if not all(isinstance(b, dict) and "object" in self.types(b) for b in resolved):
            return None
        for name in (resolved[0].get("properties") or {}):
            subs = [(b.get("properties") or {}).get(name) for b in resolved]
            pins = [self.pinned(sub) for sub in subs]
            if any(p is None for p in pins) or sum(len(p) for p in pins) != len(set().union(*pins)):
                # a property whose schemas admit no common value (`{"kind": {"enum": [...]}}` one level down)
                pairs = [(i, j) for i in range(len(subs)) for j in range(i + 1, len(subs))]
                if len(subs) > 8 or any(sub is None for sub in subs) or not all(
                        self.pair_disjoint(subs[i], subs[j], 1) for i, j in pairs):
                    continue
            out = []
            for b in resolved:
                b = copy.deepcopy(b)
                b["type"] = "object"
                b["required"] = list(dict.fromkeys((b.get("required") or []) + [name]))
                out.append(b)
            return out
        return None

    def exclusive(self, branches: list, parent: dict) -> list | None:
        """Object branches narrowed to exclude one another: each forbids the names the others require
        and it does not (so the one an instance matches is decided by which names it has). None where
        two branches require the same names, or a forbidden name is one the parent requires."""
        resolved = [self.deref(b) for b in branches]
        if not all(isinstance(b, dict) and "object" in self.types(b) for b in resolved):
            return None
        needs = [set(b.get("required") or []) for b in resolved]
        if len({frozenset(n) for n in needs}) < len(needs):
            return None
        out = []
        for i, b in enumerate(resolved):
            forbid = set().union(*(needs[j] - needs[i] for j in range(len(needs)) if j != i))
            if forbid & set(parent.get("required") or []):
                return None
            b = copy.deepcopy(b)
            b["type"] = "object"
            for name in sorted(forbid):
                b.setdefault("properties", {})[name] = False
            out.append(b)
        return out

    def pinned(self, sub: Any) -> set[str] | None:
        """The values a subschema allows (as JSON text), where it pins them (const, enum, or an allOf
        with such parts)."""
        sub = self.deref(sub)
        if isinstance(sub, dict) and isinstance(sub.get("allOf"), list):
            sets = [v for v in (self.pinned(p) for p in sub["allOf"]) if v is not None]
            return set.intersection(*sets) if sets else None
        return pinned_values(sub)

    def closed_object(self, branch: Any) -> Any:
        """An object branch of a oneOf narrowed so that branches become disjoint: no other properties
        than it names, at least one of them present, its own narrowings applied (`not` of a name)."""
        b = self.deref(branch)
        if not isinstance(b, dict) or self.types(b) != {"object"} or any(
                k in b for k in ("patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")):
            return branch
        b = copy.deepcopy(b)
        b["type"] = "object"
        self.narrow_keywords(b, None)
        if "allOf" in b:
            return branch
        if "additionalProperties" not in b:
            for name in b.get("required") or []:
                b.setdefault("properties", {}).setdefault(name, {})
            b["additionalProperties"] = False
        named = [n for n, sub in (b.get("properties") or {}).items() if sub is not False]
        if b["additionalProperties"] is False and not b.get("required") and named:
            b["required"] = [named[0]]  # else `{}` would match every such branch
        return b


def _values(pinned: set[str]) -> set[str]:
    """Pinned values (JSON texts) as JSON compares them: 1.0 is 1."""
    out = set()
    for text in pinned:
        v = json.loads(text)
        out.add(json.dumps(int(v)) if isinstance(v, float) and v.is_integer() else text)
    return out


def _above(x: dict, y: dict) -> bool:
    """Whether by their bounds every number x admits lies above every number y admits (a draft-4 boolean
    `exclusiveMinimum` is left out: its bound then reads as inclusive, a wider range)."""
    def bounds(s: dict, keys: tuple[str, str]) -> list[tuple[float, bool]]:
        return [(s[k], k == keys[1]) for k in keys if isinstance(s.get(k), (int, float)) and not isinstance(s[k], bool)]

    return any(low > high or (low == high and (open_low or open_high))
               for low, open_low in bounds(x, ("minimum", "exclusiveMinimum"))
               for high, open_high in bounds(y, ("maximum", "exclusiveMaximum")))


def _count(s: dict, key: str, default: int = 0) -> int:
    """A count keyword's value (minProperties, maxItems), or `default` where it is absent or not a count."""
    v = s.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default
