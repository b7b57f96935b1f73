"""`allOf` merged into its parent keyword by keyword: bounds tighten, types and enums intersect, required
names unite, a property both parts constrain gets both; what cannot merge exactly is refused."""

from __future__ import annotations

import copy

from plait.runtime.constrained.schema_keywords import (ANNOTATIONS, ASSERTING, CLASH, MAX_BRANCH_PAIRS, conjunction,
                                                       make_impossible, merge_keyword)


class Merging:
    """Methods of the schema walker (schema_policy._Walker), which holds the state they share."""

    def merge_all_of(self, s: dict, ptr: str) -> None:
        """Merge `allOf` parts into their parent, keyword by keyword, where the conjunction has a form
        the backends take (exact): bounds tighten, types and enums intersect, required names unite, a
        property both constrain gets both (as its own allOf), and `additionalProperties` keeps applying
        to the names its own part did not list."""
        parts = s.pop("allOf")
        if not isinstance(parts, list):
            self.bad(f"{ptr}/allOf", "'allOf' that is not a list")
            return
        queue = [(f"{ptr}/allOf/{i}", part) for i, part in enumerate(parts)]
        while queue:
            where, part = queue.pop(0)
            if part is True:
                continue
            if not isinstance(part, dict):
                self.bad(where, "'allOf' with a false part")
                continue
            if self.unfetched(part.get("$ref"), where):
                return make_impossible(s)
            if "$ref" in part and len([k for k in part if k not in ANNOTATIONS]) == 1:
                target = self.resolve(part["$ref"], where)
                if not isinstance(target, dict) or "$ref" in target:
                    self.bad(where, "'allOf' of a reference that cannot be merged")
                    continue
                part, where = target, part["$ref"]
            part = copy.deepcopy(part)
            if not self.own_unevaluated(part, where):
                continue
            self.exact_format(part, where)
            self.infer_type(part, where)
            self.if_then_else(part, where, context=s)
            if self.narrow:
                self.narrow_keywords(part, where)
            # a part's own parts next, before the following parts (a narrowed `if` is merged before the next is judged)
            queue[0:0] = [(f"{where}/allOf/{i}", sub) for i, sub in enumerate(part.pop("allOf", None) or [])]
            if "oneOf" in part:
                self.origins[id(s)] = (s, where)  # s kept alive: its id names no other schema
            self.merge_part(s, part, where)

    def merge_part(self, s: dict, part: dict, where: str) -> None:
        for closer, other in ((s, part), (part, s)):  # names one part did not list meet its additionalProperties
            extra = closer.get("additionalProperties", True)
            if extra is True:
                continue
            for name in list(other.get("properties") or {}):
                if name in (closer.get("properties") or {}):
                    continue
                if closer.get("patternProperties"):
                    self.bad(where, "'allOf' whose parts list different properties beside patternProperties")
                    return
                closer.setdefault("properties", {})[name] = copy.deepcopy(extra)
        for x, y in ((s, part), (part, s)):  # x's items (without a prefix) apply to y's prefix positions too
            if "prefixItems" in y and "prefixItems" not in x and "items" in x and isinstance(y["prefixItems"], list):
                y["prefixItems"] = [conjunction(p, copy.deepcopy(x["items"])) for p in y["prefixItems"]]
        for key, value in part.items():
            if key not in ASSERTING:
                continue
            if key not in s or s[key] == value:
                s[key] = value
                continue
            if key == "anyOf" and isinstance(value, list) and isinstance(s[key], list):
                # (A1 or A2) and (B1 or B2): every pair, less those no instance satisfies
                merged = [conjunction(x, y) for x in s[key] for y in value if not self.pair_disjoint(x, y)]
                merged = merged if 0 < len(merged) <= MAX_BRANCH_PAIRS else CLASH
            else:
                merged = merge_keyword(key, s[key], value)
            if key == "pattern" and self.may_add_pattern(s):
                self.add_pattern(s, value)
                continue
            if merged is CLASH and key in ("type", "enum", "const"):
                return make_impossible(s)  # no value is of both types or both values: the parts clash
            if merged is CLASH:
                self.bad(where, f"'allOf' whose parts both constrain {key!r}")
            else:
                s[key] = merged
