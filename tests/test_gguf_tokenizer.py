"""A GGUF's SentencePiece ('llama') vocabulary rebuilt as a `tokenizers` Tokenizer
(frontend/gguf_tokenizer.py) tokenizes as llama.cpp's algorithm does (llm_tokenizer_spm, written
out below as the oracle: the highest-scoring adjacent pair merges first, unknown characters fall
back to <0xXX> byte tokens, a space goes before the text and after each special token) and
decodes back to the text."""

from __future__ import annotations

from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

from strata_compiler.frontend.gguf_tokenizer import build_tokenizer_json  # noqa: E402

SP = "\u2581"
CORPUS = ("the cat sat on the mat with the other cat and the hat then the rat ate the oat "
          "in the heat of the theatre there was a thin thing that sang")


class _Meta:
    def __init__(self, fields: dict):
        self.fields, self.path = fields, Path("test.gguf")

    def get(self, key, kind=None, default=None, required=False):
        if key not in self.fields:
            if required:
                raise KeyError(key)
            return default
        return self.fields[key]


def _vocab():
    """Specials, 256 byte tokens, the corpus' characters, then frequent merges with falling scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    text = SP + CORPUS.replace(" ", SP)
    for ch in sorted(set(text)):
        tokens.append(ch), types.append(1), scores.append(-100.0)
    pieces = list(text)
    score = -1.0
    for _ in range(40):          # BPE on the corpus: the most frequent pair becomes a piece
        counts = {}
        for a, b in zip(pieces, pieces[1:]):
            counts[a + b] = counts.get(a + b, 0) + 1
        best = max(sorted(counts), key=counts.get)
        if best in tokens:
            break
        tokens.append(best), types.append(1), scores.append(score)
        score -= 1.0
        out, i = [], 0
        while i < len(pieces):
            if i + 1 < len(pieces) and pieces[i] + pieces[i + 1] == best:
                out.append(best)
                i += 2
            else:
                out.append(pieces[i])
                i += 1
        pieces = out
    return tokens, types, scores


def _llama_cpp_spm(text: str, tokens, types, scores, specials=("<s>", "</s>")) -> list[int]:
    """llama.cpp's SentencePiece tokenization (llama-vocab.cpp, llm_tokenizer_spm), BOS first."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (1, 2, 3)}
    out = [1]
    frags, rest = [], text
    while rest:                  # split out special tokens
        hits = [(rest.find(s), s) for s in specials if s in rest]
        if not hits:
            frags.append(rest)
            break
        at, s = min(hits)
        if at:
            frags.append(rest[:at])
        frags.append((s,))
        rest = rest[at + len(s):]
    prev_special = True
    for f in frags:
        if isinstance(f, tuple):
            out.append(vocab[f[0]])
            prev_special = True
            continue
        sym = list((SP if prev_special else "") + f.replace(" ", SP))
        prev_special = False
        while True:
            best = None
            for i in range(len(sym) - 1):
                m = sym[i] + sym[i + 1]
                if m in vocab and (best is None or scores[vocab[m]] > scores[vocab[best[1]]]):
                    best = (i, m)
            if best is None:
                break
            i, m = best
            sym[i:i + 2] = [m]
        for s in sym:
            if s in vocab:
                out.append(vocab[s])
            else:
                out.extend(tokens.index(f"<0x{b:02X}>") for b in s.encode())
    return out


@pytest.fixture(scope="module")
def tok():
    tokens, types, scores = _vocab()
    meta = _Meta({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
                  "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
                  "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0})
    return tokenizers.Tokenizer.from_str(build_tokenizer_json(meta).decode()), (tokens, types, scores)


@pytest.mark.parametrize("text", ["the cat sat on the mat", "  the  theatre", "thin thing, 42 ÿ €", "the cat</s> sat<s>x",
                                  "zebra", "a"])
def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp(tok, text):
    t, (tokens, types, scores) = tok
    assert t.encode(text).ids == _llama_cpp_spm(text, tokens, types, scores)
    if "<" not in text:
        assert t.decode(t.encode(text).ids, skip_special_tokens=True) == text
