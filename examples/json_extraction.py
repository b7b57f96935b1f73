"""JSON extraction with a schema: every output validates (grammar-constrained decoding)."""

import json

import plait as pl
from _common import backend_from_args

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "city": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "occupation": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]}},
    "required": ["name", "city", "age", "occupation"]}


@pl.function
def extract(s, text):
    s += pl.system("Extract the person described in the text as JSON.")
    s += pl.user(text)
    s += pl.assistant(pl.gen("person", json_schema=SCHEMA, max_tokens=96, temperature=0))


if __name__ == "__main__":
    backend = backend_from_args(__doc__)
    texts = ["Maria Lopez, 34, teaches chemistry at a high school in Seville.",
             "Kenji is a 51-year-old surgeon who lives in Osaka."]
    for s in extract.run_batch([{"text": t} for t in texts], backend=backend):
        print(json.dumps(json.loads(s["person"]), ensure_ascii=False))
    backend.shutdown()
