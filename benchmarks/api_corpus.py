"""Build the API-schema corpus (benchmarks/data/api_schemas.jsonl.gz): the JSON schemas real APIs, tool sets and
applications publish, none drawn from the tests' corpus (tests/data/schemas), in its row format, for

    python benchmarks/bench_structured.py --corpus benchmarks/data/api_schemas.jsonl.gz --only-compile

Sources (each row names its own, with the version or commit read):
- request bodies and returned objects of three large public OpenAPI specs (Discord's and OpenAI's in 3.1, Twilio's in 3.0): every
  `components/schemas` reference becomes a `$defs` entry holding only what the body reaches;
- Vega-Lite's whole schema and its chart and config roots (the `altair` wheel on PyPI);
- tool definitions: the Berkeley Function Calling Leaderboard's (the `bfcl-eval` wheel on PyPI; its
  Python-flavoured types `dict`, `float`, `tuple`, `any` as JSON Schema's);
- application settings schemas shipped in npm packages (Biome, Nx, Lerna, Turborepo, markdownlint, ...).

    python benchmarks/api_corpus.py --discord DIR --openai DIR --twilio DIR --wheels DIR --npm DIR

DIR of a spec: a checkout of its repository; --wheels: `pip download --no-deps altair==6.3.0 bfcl-eval==2026.3.23`;
--npm: the packages' `npm pack` tarballs. The rows are sampled with a fixed seed: the same sources give the same file.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import io
import json
import os
import random
import re
import subprocess
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "api_schemas.jsonl.gz")
_SEED = 20261207
_MAX_BYTES = 400_000  # a row's schema at most (Vega-Lite's whole schema is the one exception, by name)


def _refs(node, found: set[str], prefix: str) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(prefix):
            found.add(ref[len(prefix):].split("/")[0])
        for v in node.values():
            _refs(v, found, prefix)
    elif isinstance(node, list):
        for v in node:
            _refs(v, found, prefix)


def _rewrite_refs(node, old: str, new: str):
    if isinstance(node, dict):
        return {k: (new + v[len(old):] if k == "$ref" and isinstance(v, str) and v.startswith(old)
                    else _rewrite_refs(v, old, new)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(v, old, new) for v in node]
    return node


def with_defs(root, defs: dict, prefix: str, new_prefix: str = "#/$defs/", key: str = "$defs") -> dict:
    """`root` with the definitions it reaches (transitively) under `key`, its references rewritten to them."""
    reached, todo = set(), set()
    _refs(root, todo, prefix)
    while todo:
        name = todo.pop()
        if name in reached or name not in defs:
            continue
        reached.add(name)
        _refs(defs[name], todo, prefix)
    schema = _rewrite_refs(copy.deepcopy(root), prefix, new_prefix)
    if not isinstance(schema, dict):
        schema = {"allOf": [schema]}
    if reached:
        schema[key] = {n: _rewrite_refs(defs[n], prefix, new_prefix) for n in sorted(reached)}
    return schema


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def _spec_file(repo: str, path: str) -> tuple[dict, str]:
    """A spec from a checkout, or from a bare mirror's HEAD; and the commit read."""
    commit = _git(repo, "rev-parse", "HEAD").strip()
    if os.path.exists(os.path.join(repo, path)):
        with open(os.path.join(repo, path)) as f:
            return json.load(f), commit
    return json.loads(_git(repo, "show", f"HEAD:{path}")), commit


def openapi_rows(name: str, repo: str, paths: list[str], source: str, license_: str, sample: int, largest: int,
                 components: int = 0) -> list[dict]:
    """Request bodies of every operation in the spec files (`largest` of the biggest, `sample` more at random), and
    `components` of its component schemas (what the API returns) as roots."""
    bodies, objects = [], []
    for path in paths:
        spec, commit = _spec_file(repo, path)
        v31 = str(spec.get("openapi", "")).startswith("3.1")
        defs = (spec.get("components") or {}).get("schemas") or {}

        def row(kind: str, key: str, root, where: dict) -> dict:
            schema = with_defs(root, defs, "#/components/schemas/")
            if not v31:  # OpenAPI 3.0 is draft 4's dialect: boolean exclusive bounds, $ref alone
                schema = {"$schema": "http://json-schema.org/draft-04/schema#", **schema}
            return {"id": f"openapi/{name}/{kind}/{key}", "source": source, "schema": schema,
                    "origin": {"path": path, "commit": commit, **where}, "license": license_,
                    "draft": "Draft202012" if v31 else "Draft4", "tests": []}

        for route, ops in sorted((spec.get("paths") or {}).items()):
            for method, op in sorted(ops.items()):
                if not isinstance(op, dict) or "requestBody" not in op:
                    continue
                content = op["requestBody"].get("content") or {}
                media = next((m for m in ("application/json", "application/x-www-form-urlencoded") if m in content),
                             None)
                if media is None or "schema" not in content[media]:
                    continue
                op_id = op.get("operationId") or f"{method}-{route}"
                bodies.append(row("body", op_id, content[media]["schema"], {"operation": f"{method.upper()} {route}"}))
        objects += [row("object", n, {"$ref": f"#/components/schemas/{n}"}, {"component": n}) for n in sorted(defs)]
    rng = random.Random(f"{_SEED}-{name}")
    bodies = [b for b in bodies if len(json.dumps(b["schema"])) <= _MAX_BYTES]
    chosen = sorted(bodies, key=lambda b: -len(json.dumps(b["schema"])))[:largest]
    rest = [b for b in bodies if b not in chosen]
    objects = [o for o in objects if len(json.dumps(o["schema"])) <= _MAX_BYTES]
    return (chosen + rng.sample(rest, min(sample, len(rest)))
            + rng.sample(objects, min(components, len(objects))))


def _wheel_json(wheels: str, stem: str, member: str) -> tuple[dict | list, str]:
    name = next(f for f in sorted(os.listdir(wheels)) if f.startswith(stem) and f.endswith(".whl"))
    with zipfile.ZipFile(os.path.join(wheels, name)) as z:
        return json.loads(z.read(member)), name


def vega_lite_rows(wheels: str) -> list[dict]:
    schema, wheel = _wheel_json(wheels, "altair-", "altair/vegalite/v6/schema/vega-lite-schema.json")
    themes, _ = _wheel_json(wheels, "altair-", "altair/vegalite/v6/schema/vega-themes.json")
    origin = {"package": wheel, "path": "altair/vegalite/v6/schema/vega-lite-schema.json"}
    rows = [{"id": "vega-lite/whole", "schema": schema}]
    defs = schema["definitions"]
    for root in ("TopLevelUnitSpec", "Config", "MarkDef", "Encoding", "AxisConfig", "LegendConfig", "Projection",
                 "Transform", "SelectionParameter"):
        if root in defs:
            rows.append({"id": f"vega-lite/{root}", "schema": {
                "$schema": schema.get("$schema"), **with_defs({"$ref": f"#/definitions/{root}"}, defs,
                                                             "#/definitions/", "#/definitions/", "definitions")}})
    out = [{**r, "source": "vega/vega-lite (in altair on PyPI)", "origin": origin, "license": "BSD-3-Clause",
            "draft": "Draft7", "tests": []} for r in rows]
    # a theme document: the Config schema's instance (a real valid document to time masks along)
    config = out[[r["id"] for r in out].index("vega-lite/Config")] if "Config" in defs else None
    if config is not None and isinstance(themes, dict):
        config["tests"] = [{"data": themes[k], "valid": True} for k in sorted(themes)[:2]]
    return out


_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "int": "integer",
               "str": "string", "bool": "boolean", "String": "string", "Boolean": "boolean", "HashMap": "object",
               "ArrayList": "array", "Array": "array", "long": "integer", "double": "number", "char": "string",
               "byte": "integer", "short": "integer", "Integer": "integer", "Long": "integer", "Float": "number",
               "Double": "number", "Bigint": "integer", "bigint": "integer", "object": "object"}


def _json_schema_types(node):
    """BFCL's parameter types as JSON Schema's (`any`: no type)."""
    if isinstance(node, dict):
        out = {k: _json_schema_types(v) for k, v in node.items() if k not in ("optional",)}
        t = node.get("type")
        if t == "any":
            out.pop("type")
        elif isinstance(t, str) and t in _BFCL_TYPES:
            out["type"] = _BFCL_TYPES[t]
        if out.get("type") == "array" and isinstance(out.get("items"), list):
            out["prefixItems"] = out.pop("items")
        return out
    if isinstance(node, list):
        return [_json_schema_types(v) for v in node]
    return node


def bfcl_rows(wheels: str, sample: int) -> list[dict]:
    name = next(f for f in sorted(os.listdir(wheels)) if f.startswith("bfcl_eval-"))
    functions = []
    with zipfile.ZipFile(os.path.join(wheels, name)) as z:
        for member in sorted(z.namelist()):
            if not member.startswith("bfcl_eval/data/") or "possible_answer" in member or not member.endswith(".json"):
                continue
            for line in io.TextIOWrapper(z.open(member), encoding="utf-8"):
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                for fn in (row.get("function") or []) if isinstance(row, dict) else []:
                    if isinstance(fn, dict) and isinstance(fn.get("parameters"), dict):
                        functions.append((member, fn))
                if isinstance(row, dict) and "parameters" in row and "name" in row:  # multi_turn_func_doc
                    functions.append((member, row))
    seen, rows = set(), []
    for member, fn in functions:
        schema = _json_schema_types(fn["parameters"])
        key = json.dumps(schema, sort_keys=True)
        if key in seen or fn["name"] in {r["origin"]["function"] for r in rows}:
            continue
        seen.add(key)
        rows.append({"id": f"bfcl/{re.sub(r'[^A-Za-z0-9_.-]+', '_', fn['name'])}", "schema": schema,
                     "source": "ShishirPatil/gorilla (bfcl-eval on PyPI)",
                     "origin": {"package": name, "path": member, "function": fn["name"]},
                     "license": "Apache-2.0", "draft": "Draft202012", "tests": []})
    rng = random.Random(f"{_SEED}-bfcl")
    return rng.sample(rows, min(sample, len(rows)))


# (package tarball prefix, member, id, licence)
_NPM_SCHEMAS = [
    ("biomejs-biome-", "package/configuration_schema.json", "biome", "MIT OR Apache-2.0"),
    ("markdownlint-", "package/schema/markdownlint-config-schema.json", "markdownlint", "MIT"),
    ("lerna-", "package/schemas/lerna-schema.json", "lerna", "MIT"),
    ("turbo-", "package/schema.json", "turbo", "MIT"),
    ("nx-", "package/schemas/nx-schema.json", "nx", "MIT"),
    ("nx-", "package/schemas/project-schema.json", "nx-project", "MIT"),
    ("nx-", "package/dist/src/executors/run-commands/schema.json", "nx-run-commands", "MIT"),
    ("changesets-config-", "package/schema.json", "changesets", "MIT"),
    ("release-it-", "package/schema/release-it.json", "release-it", "MIT"),
    ("commitlint-config-validator-", "package/lib/commitlint.schema.json", "commitlint", "MIT"),
    ("jsonresume-schema-", "package/schema.json", "jsonresume", "MIT"),
    ("jsonresume-schema-", "package/job-schema.json", "jsonresume-job", "MIT"),
    ("app-builder-lib-", "package/scheme.json", "electron-builder", "MIT"),
    ("angular-cli-", "package/lib/config/schema.json", "angular-workspace", "MIT"),
]


def npm_rows(npm: str) -> list[dict]:
    rows = []
    for prefix, member, name, license_ in _NPM_SCHEMAS:
        tarball = next((f for f in sorted(os.listdir(npm)) if f.startswith(prefix) and f.endswith(".tgz")
                        and f[len(prefix)].isdigit()), None)
        if tarball is None:
            continue
        with tarfile.open(os.path.join(npm, tarball)) as t:
            schema = json.load(t.extractfile(member))
        draft = "Draft7"
        uri = str(schema.get("$schema", ""))
        if "2020-12" in uri:
            draft = "Draft202012"
        elif "2019-09" in uri:
            draft = "Draft201909"
        elif "draft-04" in uri:
            draft = "Draft4"
        elif "draft-06" in uri:
            draft = "Draft6"
        rows.append({"id": f"settings/{name}", "schema": schema, "source": f"npm: {tarball[:-4]}",
                     "origin": {"package": tarball, "path": member}, "license": license_, "draft": draft, "tests": []})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--discord", required=True)
    ap.add_argument("--openai", required=True)
    ap.add_argument("--twilio", required=True)
    ap.add_argument("--wheels", required=True)
    ap.add_argument("--npm", required=True)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    twilio = ["spec/json/twilio_api_v2010.json", "spec/json/twilio_conversations_v1.json",
              "spec/json/twilio_messaging_v1.json", "spec/json/twilio_flex_v1.json", "spec/json/twilio_numbers_v2.json"]
    rows = (openapi_rows("discord", args.discord, ["specs/openapi.json"], "discord/discord-api-spec", "MIT", 26, 4, 8)
            + openapi_rows("openai", args.openai, ["openapi.json"], "openai/openai-openapi", "MIT", 22, 3, 8)
            + openapi_rows("twilio", args.twilio, twilio, "twilio/twilio-oai", "MIT", 20, 2, 10)
            + vega_lite_rows(args.wheels) + bfcl_rows(args.wheels, 45) + npm_rows(args.npm))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with (gzip.open if args.out.endswith(".gz") else open)(args.out, "wt") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    sizes = sorted(len(json.dumps(r["schema"])) for r in rows)
    print(f"{len(rows)} schemas in {args.out}; sizes p50 {sizes[len(sizes) // 2]} B, max {sizes[-1]} B")


if __name__ == "__main__":
    main()
