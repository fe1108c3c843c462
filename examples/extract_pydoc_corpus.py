"""Plain-text corpus from Debian's Python documentation package (HTML -> paragraphs).

    apt-get download python3.11-doc          # python3.11-doc_3.11.2-6+deb12u8_all.deb
    python examples/extract_pydoc_corpus.py python3.11-doc_*.deb OUT_DIR

writes OUT_DIR/train.txt, OUT_DIR/calib.txt, OUT_DIR/heldout.txt and OUT_DIR/split.json.
The argument may also be an already extracted html folder (.../share/doc/python3.11/html).

Extraction (standard library only: html.parser): the text of each page's main body
(`<div class="body" role="main">`), one paragraph per block element (p, headings, list items,
definition terms/descriptions, table cells); code blocks (`<pre>`), permalink marks, section
numbers, scripts and navigation are dropped. Paragraphs with few letters are dropped.

Split, by document (one HTML page = one document), deterministic: the pages are shuffled with a
fixed seed; pages of at most MAX_EVAL_DOC_WORDS words go to the held-out set until it holds
~EVAL_WORDS words, then to the calibration set likewise; everything else is training text. The
three sets share no document. In every output file paragraphs are separated by one blank line and
documents by a line holding only `<|endoftext|>` (train.txt) or two blank lines (calib/heldout).
"""

from __future__ import annotations

import argparse
import html.parser
import json
import random
import re
import subprocess
import tempfile
from pathlib import Path

EVAL_WORDS = 50_000
MAX_EVAL_DOC_WORDS = 6_000
SEED = 1234
DOC_SEP = "<|endoftext|>"

# Pages that are not prose: indexes, tables of contents, licences, change logs.
SKIP_PAGES = {
    "genindex.html", "py-modindex.html", "search.html", "contents.html", "index.html",
    "copyright.html", "license.html", "about.html", "bugs.html", "glossary.html",
    "whatsnew/changelog.html", "download.html",
}
SKIP_PREFIXES = ("genindex-", "_", "includes/")

BLOCK = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "td", "th", "caption",
         "blockquote", "div", "section", "table", "tr", "ul", "ol", "dl", "figure", "figcaption"}
SKIP_TAGS = {"pre", "script", "style", "nav", "button"}
SKIP_CLASSES = {"headerlink", "section-number", "highlight", "sphinxsidebar", "related", "footer",
                "linenos", "versionmodified-hidden"}
VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area", "base", "source"}


class _Extractor(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, starts main body, skipped)
        self.in_body = 0
        self.skip = 0
        self.buf: list[str] = []
        self.paragraphs: list[str] = []

    def _flush(self) -> None:
        text = re.sub(r"\s+", " ", "".join(self.buf)).strip()
        self.buf = []
        if text:
            self.paragraphs.append(text)

    def handle_starttag(self, tag, attrs):
        if tag in VOID:
            if tag == "br":
                self.buf.append(" ")
            return
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        body = tag == "div" and "body" in classes and a.get("role") == "main"
        skipped = tag in SKIP_TAGS or bool(classes & SKIP_CLASSES)
        self.stack.append((tag, body, skipped))
        if body:
            self.in_body += 1
        if skipped:
            self.skip += 1
        if tag in BLOCK and self.in_body and not self.skip:
            self._flush()

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        # Pop to the matching tag (tolerates unclosed <p>, <li>, ...).
        for j in range(len(self.stack) - 1, -1, -1):
            if self.stack[j][0] == tag:
                break
        else:
            return
        while len(self.stack) > j:
            t, body, skipped = self.stack.pop()
            if t in BLOCK and self.in_body and not self.skip:
                self._flush()
            if skipped:
                self.skip -= 1
            if body:
                self._flush()
                self.in_body -= 1

    def handle_data(self, data):
        if self.in_body and not self.skip:
            self.buf.append(data)


def _keep(par: str) -> bool:
    letters = sum(c.isalpha() for c in par)
    return letters >= 0.5 * len(par) and len(par.split()) >= 3


def extract_page(path: Path) -> list[str]:
    p = _Extractor()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    p.close()
    out = []
    for par in p.paragraphs:
        par = par.replace("\u00b6", "").strip()
        if _keep(par) and (not out or out[-1] != par):
            out.append(par)
    return out


def _pages(html_dir: Path) -> list[Path]:
    pages = []
    for f in sorted(html_dir.rglob("*.html")):
        rel = f.relative_to(html_dir).as_posix()
        if rel in SKIP_PAGES or rel.startswith(SKIP_PREFIXES):
            continue
        pages.append(f)
    return pages


def build(html_dir: Path, out_dir: Path) -> dict:
    docs = []
    for f in _pages(html_dir):
        pars = extract_page(f)
        words = sum(len(p.split()) for p in pars)
        if words >= 50:
            docs.append((f.relative_to(html_dir).as_posix(), pars, words))
    order = list(range(len(docs)))
    random.Random(SEED).shuffle(order)
    split = {"heldout": [], "calib": [], "train": []}
    totals = {"heldout": 0, "calib": 0, "train": 0}
    for i in order:
        name, _, words = docs[i]
        target = "train"
        if words <= MAX_EVAL_DOC_WORDS:
            for s in ("heldout", "calib"):
                if totals[s] < EVAL_WORDS:
                    target = s
                    break
        split[target].append(i)
        totals[target] += words
    out_dir.mkdir(parents=True, exist_ok=True)
    for s, idx in split.items():
        idx = sorted(idx)  # file order within a set
        texts = ["\n\n".join(docs[i][1]) for i in idx]
        sep = f"\n\n{DOC_SEP}\n\n" if s == "train" else "\n\n\n"
        (out_dir / f"{s}.txt").write_text(sep.join(texts) + "\n", encoding="utf-8")
    meta = {
        "documents": {s: [docs[i][0] for i in sorted(idx)] for s, idx in split.items()},
        "words": totals,
        "seed": SEED,
    }
    (out_dir / "split.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="python3.X-doc .deb, or its html folder")
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args(argv)
    if args.source.suffix == ".deb":
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["dpkg-deb", "-x", str(args.source), tmp], check=True)
            found = sorted(Path(tmp).glob("usr/share/doc/python3*/html/index.html"))
            found = [f for f in found if not f.parent.is_symlink()]
            if not found:
                raise SystemExit(f"error: no usr/share/doc/python3*/html in {args.source}")
            meta = build(found[0].parent, args.out_dir)
    else:
        meta = build(args.source, args.out_dir)
    n = {s: len(v) for s, v in meta["documents"].items()}
    print(f"documents {n} | words {meta['words']} -> {args.out_dir}")


if __name__ == "__main__":
    main()
