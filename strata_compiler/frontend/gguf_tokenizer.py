"""A GGUF file's tokenizer rebuilt as a `tokenizers` Tokenizer (JSON), so that a plan compiled from
it reads and writes text: byte-level BPE vocabularies ('gpt2', with the pre-tokenizer families
whose llama.cpp regexes map exactly onto HF's) and SentencePiece ones ('llama'). Anything else
gives None and one warning (the plan then takes token ids).

The file is untrusted: token_type, scores and merges must hold one item of the right kind per token
(merges: "a b"), no token may exceed MAX_TOKEN_BYTES, and the SentencePiece merge search (every
split of every piece, quadratic in a piece's length) is bounded by MAX_SEARCH_CHARS, MAX_MERGES and
MAX_MERGE_CHARS. Any failure of the rebuild is one ModelError naming the file and the field."""

from __future__ import annotations

import math
import sys

from ..errors import ModelError

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp), as `tokenizers` parts.
# Only the families whose llama.cpp regexes map exactly onto HF pre-tokenizers are rebuilt.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_GPT2 = ("gpt-2", "phi-2", "jina-es", "jina-de", "mpt", "olmo", "jais", "trillion")
_LLAMA3 = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = ("qwen2",)     # Qwen2/Qwen3 (and their MoE) files: llama3's split with single digits
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4      # tokenizer.ggml.token_type values
_TOKEN_TYPES = range(0, 7)      # llama.cpp's: undefined, normal, unknown, control, user-defined, unused, byte

# Real vocabularies' longest tokens are runs of spaces or newlines of a few hundred bytes (SmolLM2's:
# 162); 1024 bounds a piece's split search at ~0.25 ms.
MAX_TOKEN_BYTES = 1024
MAX_SEARCH_CHARS = 1 << 23      # characters of normal SentencePiece pieces searched (~0.5 us each: <= 4 s)
MAX_MERGES = 1 << 21            # merges a SentencePiece vocabulary gives (a 262k one: ~0.3-0.5M)
MAX_MERGE_CHARS = 1 << 24       # their text, which the tokenizer's JSON spells out


def _warn(msg: str) -> None:
    sys.stderr.write(f"warning: {msg}\n")


def build_tokenizer_json(meta) -> bytes | None:
    """A `tokenizers` Tokenizer (JSON) equivalent to llama.cpp's for a GGUF's byte-level BPE ('gpt2')
    or SentencePiece ('llama') vocabulary, else None."""
    from ..errors import StrataError

    try:
        return _build(meta)
    except StrataError:
        raise
    except Exception as e:      # noqa: BLE001 - `tokenizers` on an untrusted vocabulary: any of its errors
        raise ModelError(f"{meta.path}: tokenizer.ggml.* does not form a tokenizer "
                         f"({str(e).splitlines()[0][:160] if str(e) else type(e).__name__})") from None


# an item kind _list checks -> (the test, its name in a message); bools are not numbers here
_KIND = {str: (lambda x: isinstance(x, str), "a string"),
         int: (lambda x: isinstance(x, int) and not isinstance(x, bool), "an integer"),
         float: (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool), "a number")}


def _list(meta, key: str, kind: type, n: int | None = None, default: list | None = None) -> list:
    """Metadata `key` as a list of `kind` (int: ints, float: numbers), of `n` items where given (one per
    token); `default` where the file has none (None: required)."""
    v = meta.get(key, list, default=default, required=default is None)
    ok, what = _KIND[kind]
    bad = next((i for i, x in enumerate(v) if not ok(x)), None)
    if bad is not None:
        raise ModelError(f"{meta.path}: {key} item {bad} is {v[bad]!r:.60}, not {what}")
    if n is not None and len(v) != n:
        raise ModelError(f"{meta.path}: {key} holds {len(v)} items, but tokenizer.ggml.tokens holds {n} tokens; "
                         "it should hold one per token")
    return v


def _token_types(meta, n: int) -> list[int]:
    """tokenizer.ggml.token_type: one of llama.cpp's types (0..6) per token; another value would be
    silently taken as neither normal nor special (the token left out of merges and added tokens)."""
    types = _list(meta, "tokenizer.ggml.token_type", int, n, default=[_NORMAL] * n)
    bad = next((i for i, t in enumerate(types) if t not in _TOKEN_TYPES), None)
    if bad is not None:
        raise ModelError(f"{meta.path}: tokenizer.ggml.token_type item {bad} is {types[bad]}, not a token type "
                         f"(llama.cpp's are {_TOKEN_TYPES.start}..{_TOKEN_TYPES.stop - 1}); re-convert the model")
    return types


def _tokens(meta) -> list[str]:
    tokens = _list(meta, "tokenizer.ggml.tokens", str)
    long = next((i for i, t in enumerate(tokens)
                 if len(t) > MAX_TOKEN_BYTES // 4 and len(t.encode()) > MAX_TOKEN_BYTES), None)
    if long is not None:
        raise ModelError(f"{meta.path}: tokenizer.ggml.tokens item {long} is {len(tokens[long].encode())} bytes long, "
                         f"more than the {MAX_TOKEN_BYTES} Strata rebuilds (real vocabularies' longest are a few "
                         "hundred)")
    return tokens


def _build(meta) -> bytes | None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    path = meta.path
    kind = meta.get("tokenizer.ggml.model", str, default=None)
    if kind is None:
        return None
    if kind == "llama":
        tokens = _tokens(meta)
        return _sentencepiece(meta, tokens, _token_types(meta, len(tokens)))
    if kind != "gpt2":
        _warn(f"{path}: tokenizer.ggml.model {kind[:60]!r} is not rebuilt (byte-level BPE 'gpt2' and SentencePiece "
              "'llama' are); the plan has no tokenizer, use strata-run --input-ids")
        return None
    pre = meta.get("tokenizer.ggml.pre", str, default="default")   # llama.cpp's default regexes differ
    if pre in _DIGITS_THEN_GPT2:
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _GPT2:
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _LLAMA3 or pre in _QWEN2:
        regex = _LLAMA3_REGEX if pre in _LLAMA3 else _QWEN2_REGEX
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        _warn(f"{path}: tokenizer.ggml.pre {pre[:60]!r} is not known here; the plan has no tokenizer, "
              "use strata-run --input-ids")
        return None
    tokens = _tokens(meta)
    merges = _list(meta, "tokenizer.ggml.merges", str)
    types = _token_types(meta, len(tokens))
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((i for i, p in enumerate(pairs) if len(p) != 2), None)
    if bad is not None:
        raise ModelError(f"{path}: tokenizer.ggml.merges item {bad} is {merges[bad]!r:.60}, not two tokens "
                         "separated by a space")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                         ignore_merges=pre in _LLAMA3)
    except Exception as e:
        raise ModelError(f"{path}: tokenizer.ggml.tokens/merges do not form a BPE vocabulary ({e})"[:300]) from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    return _finish(meta, tok, tokens, types, add_bos=pre in _LLAMA3)


def _finish(meta, tok, tokens: list, types: list, add_bos: bool) -> bytes:
    """The file's control and user-defined tokens as added tokens, BOS / EOS as the file says to
    add them; the tokenizer as JSON."""
    from tokenizers import AddedToken, processors

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    add_bos = meta.get("tokenizer.ggml.add_bos_token", bool, default=add_bos)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", bool, default=False)
    bos = meta.get("tokenizer.ggml.bos_token_id", int, default=-1)
    eos = meta.get("tokenizer.ggml.eos_token_id", int, default=-1)
    single, specials = ["$A"], []
    if add_bos and 0 <= bos < len(tokens):
        single.insert(0, tokens[bos])
        specials.append((tokens[bos], bos))
    if add_eos and 0 <= eos < len(tokens):
        single.append(tokens[eos])
        specials.append((tokens[eos], eos))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
    return tok.to_str().encode()


def _sentencepiece(meta, tokens: list, types: list) -> bytes:
    """llama.cpp's 'llama' vocabulary (SentencePiece BPE: pieces with scores, byte fallback) as a
    `tokenizers` BPE: the merges are every split of a piece into two pieces of the vocabulary,
    ranked by the piece's score (as transformers' SentencePiece converter makes them)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    path = meta.path
    scores = _list(meta, "tokenizer.ggml.scores", float, len(tokens))
    bad = next((i for i, x in enumerate(scores) if math.isnan(x)), None)
    if bad is not None:     # NaN sorts nowhere: the merges' ranks would be arbitrary, the tokenizer wrong
        raise ModelError(f"{path}: tokenizer.ggml.scores item {bad} is NaN, not a score; re-convert the model")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges: list[tuple[str, str]] = []
    searched = merge_chars = 0
    for i in sorted(range(len(tokens)), key=lambda i: -scores[i]):
        piece = tokens[i]
        if types[i] != _NORMAL or vocab[piece] != i:
            continue
        searched += len(piece)
        if searched > MAX_SEARCH_CHARS:
            raise ModelError(f"{path}: tokenizer.ggml.tokens: the SentencePiece pieces hold more than "
                             f"{MAX_SEARCH_CHARS} characters, more than Strata rebuilds merges for (real "
                             "vocabularies: a few million)")
        # ids, so that each merge holds the vocabulary's own strings rather than fresh copies
        local = sorted((vocab[piece[:k]], vocab[piece[k:]]) for k in range(1, len(piece))
                       if piece[:k] in vocab and piece[k:] in vocab)
        merges.extend((tokens[a], tokens[b]) for a, b in local)
        merge_chars += len(local) * len(piece)
        if len(merges) > MAX_MERGES or merge_chars > MAX_MERGE_CHARS:
            raise ModelError(f"{path}: tokenizer.ggml.tokens: the SentencePiece pieces split into more than "
                             f"{MAX_MERGES} merges ({MAX_MERGE_CHARS} characters), more than Strata rebuilds (a "
                             "262k vocabulary gives ~0.5M)")
    unk = meta.get("tokenizer.ggml.unknown_token_id", int, default=-1)
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk] if 0 <= unk < len(tokens) else None,
                         fuse_unk=True, byte_fallback=True)
    except Exception as e:
        raise ModelError(f"{path}: tokenizer.ggml.tokens/scores do not form a SentencePiece vocabulary ({e})"[:300]) from None
    tok = Tokenizer(bpe)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", bool, default=True)
    # llama.cpp puts a space before the text and after each special token, then spaces become
    # U+2581: a normalizer does the same (it runs on each stretch of text between added tokens)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581")] * prefix + [normalizers.Replace(" ", "\u2581")])
    parts = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(parts + [decoders.Strip(" ", 1, 0)] * prefix)
    return _finish(meta, tok, tokens, types, add_bos=True)
