"""The server's prompt cache (runtime/prompt_cache.py): a hit gives the logits of a fresh prefill,
the LRU stays within its bytes, files in --kv-cache-dir survive a restart and damaged ones are
skipped with a warning (hostile folders and files: test_hostile_prompt_cache.py)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.prompt_cache import PromptCache
from strata_compiler.runtime.session import Session


@pytest.fixture(scope="module")
def plan(tiny_f32_plan):
    return load_plan(tiny_f32_plan)


def _shape(plan):
    m = plan.meta["model"]
    return m["n_layers"], m["n_kv_heads"], m["head_dim"]


@pytest.mark.parametrize("backend", ["reference", "llvm", "xla"])
def test_hit_gives_the_logits_of_a_fresh_prefill(plan, backend):
    vocab = plan.meta["model"]["vocab_size"]
    ids = np.random.default_rng(1).integers(0, vocab, 40)
    s = Session(plan, backend)
    s.reset(1, 128)
    fresh = s.step(ids[None])[:, -1]
    pc = PromptCache(64 << 20, plan.digest(), shape=_shape(plan))
    s.reset(1, 128)
    s.step(ids[None, :24])
    pc.store(ids[:24], s.cache, 0)
    s.reset(1, 128)
    assert pc.load(ids[:-1], s.cache, 0) == 24 and int(s.cache.lengths[0]) == 24
    hit = s.step(ids[None, 24:])[:, -1]
    assert np.abs(hit - fresh).max() <= 1e-5 * fresh.std()
    # a prompt that shares only the first 10 tokens with the entry reuses those 10
    other = np.concatenate([ids[:10], (ids[10:30] + 1) % vocab])
    s.reset(1, 128)
    assert pc.load(other, s.cache, 0) == 10


def test_lru_bound_and_superseded_entries(plan):
    s = Session(plan, "reference")
    vocab = plan.meta["model"]["vocab_size"]
    ids = np.random.default_rng(2).integers(0, vocab, 64)
    s.reset(1, 128)
    s.step(ids[None])
    one = PromptCache(1 << 30, plan.digest(), shape=_shape(plan))
    one.store(ids[:16], s.cache, 0)
    per16 = one.bytes
    one.store(ids[:32], s.cache, 0)         # extends the first entry: it replaces it
    assert len(one.entries) == 1 and one.bytes > per16
    one.store(ids[:20], s.cache, 0)         # already covered by the longer one
    assert len(one.entries) == 1
    small = PromptCache(int(per16 * 2.5), plan.digest(), shape=_shape(plan))
    for start in (0, 16, 32):               # three unrelated entries of 16 tokens: the oldest goes
        s.reset(1, 128)
        s.step(ids[None, start:start + 16])
        small.store(ids[start:start + 16], s.cache, 0)
    assert len(small.entries) == 2 and small.bytes <= small.max_bytes
    s.reset(1, 128)
    assert small.load(ids[:16], s.cache, 0) == 0 and small.load(ids[32:48], s.cache, 0) == 16


def test_folder_survives_a_restart_and_damage_is_skipped(plan, tmp_path, capsys):
    s = Session(plan, "reference")
    vocab = plan.meta["model"]["vocab_size"]
    ids = np.random.default_rng(3).integers(0, vocab, 48)
    s.reset(1, 128)
    s.step(ids[None])
    pc = PromptCache(64 << 20, plan.digest(), tmp_path, shape=_shape(plan))
    pc.store(ids[:20], s.cache, 0)
    s2 = Session(plan, "reference")
    s2.reset(1, 128)
    s2.step(ids[None, 24:44])
    pc.store(ids[24:44], s2.cache, 0)
    assert pc.save() == 2
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) == 2 and sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".kv") == ["hmac.key"]
    raw = bytearray(files[0].read_bytes())
    raw[-5] ^= 0xFF                         # one flipped byte in the payload
    files[0].write_bytes(bytes(raw))
    again = PromptCache(64 << 20, plan.digest(), tmp_path, shape=_shape(plan))
    err = capsys.readouterr().err
    assert err.count("warning: prompt cache file") == 1 and "MAC does not verify" in err
    assert len(again.entries) == 1
    kept = next(iter(again.entries.values())).tokens
    s.reset(1, 128)
    assert again.load(kept, s.cache, 0) == len(kept)
    other = PromptCache(64 << 20, "another plan", tmp_path, shape=_shape(plan))
    assert not other.entries and not capsys.readouterr().err     # another plan's files: skipped, not judged
    (tmp_path / "junk.kv").write_bytes(b"STRATAKV\xff\xff\xff\xff")
    PromptCache(64 << 20, plan.digest(), tmp_path, shape=_shape(plan))
    assert "header length" in capsys.readouterr().err


def test_an_entry_read_from_a_file_goes_into_a_device_cache(plan, tmp_path):
    """Entries read from --kv-cache-dir are host arrays; an xla session's cache is on its device."""
    vocab = plan.meta["model"]["vocab_size"]
    ids = np.random.default_rng(4).integers(0, vocab, 40)
    ref = Session(plan, "reference")
    ref.reset(1, 128)
    ref.step(ids[None, :24])
    pc = PromptCache(64 << 20, plan.digest(), tmp_path, shape=_shape(plan))
    pc.store(ids[:24], ref.cache, 0)
    assert pc.save() == 1
    again = PromptCache(64 << 20, plan.digest(), tmp_path, shape=_shape(plan))
    s = Session(plan, "xla")
    s.reset(1, 128)
    fresh = s.step(ids[None])[:, -1]
    s.reset(1, 128)
    s.step(ids[None, :1])             # the cache on the device
    s.cache.lengths[0] = 0
    assert again.load(ids[:-1], s.cache, 0) == 24
    hit = s.step(ids[None, 24:])[:, -1]
    assert np.abs(hit - fresh).max() <= 1e-4 * fresh.std()
