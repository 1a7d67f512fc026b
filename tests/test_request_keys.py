"""Chunk keys against vLLM's own block hashes, on real scheduler-side `Request`s.

Wherever vLLM's prefix cache tells two requests' KV apart, the chunk keys must too, from
the same chunk on; where vLLM's block hashes are equal, so are the keys (except where the
keys are stricter: the LoRA adapter's bytes, the mixed-prompt mask).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from needs import require

require("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.pooling_params import PoolingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from gemma4_kv.keys.request import RequestKeys, RequestKeyer, Uncacheable  # noqa: E402
from keyer import chunk_keys  # noqa: E402

CHUNK = 256
BLOCK = 32  # vLLM's hash block (the gcd of Gemma 4's group block sizes)
N = 1100  # 4 full chunks
IMAGE_TOKEN = 9

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)
_ids = iter(range(10**9))


def request(tokens=None, *, images=(), embeds=None, mask=None, salt=None, lora=None,
            pooling=False, **kw) -> Request:
    """A scheduler-side request as vLLM's engine core builds it, with its block hashes."""
    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                   mm_position=PlaceholderRange(offset=off, length=n))
             for ident, off, n in images]
    return Request(f"req-{next(_ids)}", tokens, None if pooling else SamplingParams(max_tokens=8),
                   PoolingParams() if pooling else None, prompt_embeds=embeds,
                   prompt_is_token_ids=mask, mm_features=feats, cache_salt=salt,
                   lora_request=lora, block_hasher=HASHER, **kw)


def base_tokens(seed=0):
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(N)]


def with_image(tokens, offset, length):
    out = list(tokens)
    out[offset:offset + length] = [IMAGE_TOKEN] * length
    return out


def first_diff(a, b):
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None)


def keys_of(req, keyer=None) -> RequestKeys:
    k = (keyer or RequestKeyer(CHUNK)).keys(req)
    assert isinstance(k, RequestKeys), k
    return k


def vllm_first_chunk(a: Request, b: Request):
    """The chunk of the first block where vLLM's block hashes differ (None: equal)."""
    blocks = CHUNK * (N // CHUNK) // BLOCK
    i = first_diff(a.block_hashes[:blocks], b.block_hashes[:blocks])
    return None if i is None else i * BLOCK // CHUNK


def check_pair(a: Request, b: Request, *, expect=None, keyer=None):
    """Our first differing chunk is vLLM's (and `expect`, if given)."""
    ka, kb = keys_of(a, keyer), keys_of(b, keyer)
    assert len(ka.hashes) == len(kb.hashes) == N // CHUNK
    ours = first_diff(ka.hashes, kb.hashes)
    assert ours == vllm_first_chunk(a, b)
    if expect is not None or ours is None:
        assert ours == expect
    if ours is not None:  # a rolling hash: every later chunk differs too
        assert all(x != y for x, y in zip(ka.hashes[ours:], kb.hashes[ours:]))
    return ka, kb


def test_same_tokens_same_keys_and_stable_encoding():
    t = base_tokens()
    check_pair(request(t), request(t), expect=None)
    # Keys do not depend on the process (no Python hash(), no pickle).
    assert keys_of(request(t)).hashes == keys_of(request(list(t))).hashes


def test_tokens_differ_from_their_chunk_on():
    t = base_tokens()
    u = list(t)
    u[600] += 1
    check_pair(request(t), request(u), expect=2)


def test_two_images_of_one_size_at_one_place_differ():
    t = with_image(base_tokens(), 800, 100)  # wholly in chunk 3
    a = request(t, images=[("hash-of-image-A", 800, 100)])
    b = request(t, images=[("hash-of-image-B", 800, 100)])
    assert list(a.all_token_ids) == list(b.all_token_ids)
    check_pair(a, b, expect=3)  # chunks 0-2 equal


def test_image_spanning_two_chunks_differs_from_the_first():
    t = with_image(base_tokens(), 700, 200)
    check_pair(request(t, images=[("A", 700, 200)]), request(t, images=[("B", 700, 200)]),
               expect=2)


def test_same_image_at_another_offset_differs():
    t = [IMAGE_TOKEN] * N  # the ids alone cannot tell where the image is
    check_pair(request(t, images=[("A", 800, 50)]), request(t, images=[("A", 810, 50)]),
               expect=3)
    # An image at the same place in its chunk, one chunk later: from its first chunk on.
    check_pair(request(t, images=[("A", 300, 50)]), request(t, images=[("A", 556, 50)]),
               expect=1)


def test_image_before_a_chunk_is_named_through_the_chain():
    t = with_image(base_tokens(), 100, 50)
    a, b = request(t, images=[("A", 100, 50)]), request(t, images=[("B", 100, 50)])
    check_pair(a, b, expect=0)


def test_several_images_in_one_chunk():
    t = with_image(with_image(base_tokens(), 520, 40), 600, 40)
    a = request(t, images=[("A", 520, 40), ("B", 600, 40)])
    b = request(t, images=[("A", 520, 40), ("C", 600, 40)])
    c = request(t, images=[("A", 520, 40), ("B", 600, 40)])
    check_pair(a, b, expect=2)
    check_pair(a, c, expect=None)


def _embeds(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 64, generator=g)


def test_prompt_embeds_differing_in_rows_950_1019_change_chunk_3_on():
    e = _embeds()
    f = e.clone()
    f[950:1020] += 1.0
    a, b = request(None, embeds=e), request(None, embeds=f)
    assert list(a.all_token_ids) == list(b.all_token_ids)  # all zeros: the ids say nothing
    check_pair(a, b, expect=3)
    check_pair(a, request(None, embeds=e.clone()), expect=None)


def test_mixed_prompt_embeds_rows_950_1019():
    t, e = base_tokens(), _embeds()
    mask = [not 950 <= i < 1020 for i in range(N)]
    f = e.clone()
    f[950:1020] += 1.0
    a = request(t, embeds=e, mask=mask)
    b = request(t, embeds=f, mask=mask)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert list(a.all_token_ids) == list(b.all_token_ids)
    check_pair(a, b, expect=3)


def test_mixed_prompt_mask_is_keyed_where_vllm_is_blind():
    """Row 300 is token id 0 in one request and an embedded row (id zeroed) in the other,
    over the same embeds: vLLM's block hashes are equal, the KV is not."""
    t, e = base_tokens(), _embeds()
    t[300] = 0
    m1 = [not 950 <= i < 1020 for i in range(N)]
    m2 = list(m1)
    m2[300] = False
    a, b = request(t, embeds=e, mask=m1), request(t, embeds=e, mask=m2)
    assert vllm_first_chunk(a, b) is None
    assert first_diff(keys_of(a).hashes, keys_of(b).hashes) == 1


def test_cache_salt_changes_every_chunk():
    t = base_tokens()
    a, b = check_pair(request(t, salt="tenant-a"), request(t, salt="tenant-b"), expect=0)
    assert not set(a.hashes) & set(b.hashes)
    check_pair(request(t, salt=""), request(t), expect=None)  # "" is no salt, as in vLLM


def _adapter(path, seed: int, rank: int = 4) -> str:
    """A peft-style adapter directory (the bytes only matter here, not the shapes)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": %d, "lora_alpha": 8, "target_modules": ["gate_proj"], '
                '"peft_type": "LORA", "bias": "none"}' % rank)
    save_file({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight":
               torch.randn(rank, 128, generator=g)},
              os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def test_lora_adapters_and_no_adapter_differ(tmp_path):
    t = base_tokens()
    a = LoRARequest("A", 1, _adapter(tmp_path / "a", 1))
    b = LoRARequest("B", 2, _adapter(tmp_path / "b", 2))
    keyer = RequestKeyer(CHUNK)
    ka, kn = check_pair(request(t, lora=a), request(t), expect=0, keyer=keyer)
    check_pair(request(t), request(t, lora=b), expect=0, keyer=keyer)
    check_pair(request(t, lora=a), request(t, lora=b), expect=0, keyer=keyer)
    assert keys_of(request(t, lora=a), keyer).hashes == ka.hashes


def test_lora_key_follows_the_adapter_bytes(tmp_path):
    t = base_tokens()
    path = _adapter(tmp_path / "a", 1)
    lora = LoRARequest("A", 1, path)
    before = keys_of(request(t, lora=lora)).hashes
    weights = os.path.join(path, "adapter_model.safetensors")
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes
    assert keys_of(request(t, lora=lora)).hashes == before
    _adapter(path, 2)  # same name, id and path; other weights
    r1, r2 = request(t, lora=lora), request(t, lora=lora)
    assert vllm_first_chunk(r1, request(t, lora=lora)) is None  # vLLM keys name and path
    after = keys_of(r1).hashes
    assert first_diff(before, after) == 0 and keys_of(r2).hashes == after


def test_adapter_digest_is_computed_once_per_version(tmp_path):
    keyer = RequestKeyer(CHUNK)
    path = _adapter(tmp_path / "a", 1)
    d1 = keyer.adapters.digest(path)
    entry = keyer.adapters._cache[path]
    assert keyer.adapters.digest(path) == d1 and keyer.adapters._cache[path] is entry
    _adapter(path, 2)
    assert keyer.adapters.digest(path) != d1


def test_lora_id_that_changes_adapter_in_a_running_engine_is_uncacheable(tmp_path):
    """vLLM keeps the weights it loaded for an int id: after the files change it is
    unknown which version runs, so that id is neither stored nor loaded any more."""
    t = base_tokens()
    keyer = RequestKeyer(CHUNK)
    path = _adapter(tmp_path / "a", 1)
    lora = LoRARequest("A", 1, path)
    running = request(t, lora=lora)
    k = keys_of(running, keyer)
    _adapter(path, 2)
    assert isinstance(keyer.keys(request(t, lora=lora)), Uncacheable)
    assert isinstance(keyer.refresh(k, running), Uncacheable)
    # Another id on another adapter is not affected; the same id on another path is.
    other = LoRARequest("B", 2, _adapter(tmp_path / "b", 3))
    assert isinstance(keyer.keys(request(t, lora=other)), RequestKeys)
    moved = LoRARequest("A", 1, _adapter(tmp_path / "c", 1))
    assert isinstance(keyer.keys(request(t, lora=moved)), Uncacheable)


@pytest.mark.parametrize("case", ["hub id", "missing", "inplace", "empty dir"])
def test_lora_that_cannot_be_identified_is_uncacheable(tmp_path, case):
    path = {"hub id": lambda: "google/some-adapter", "missing": lambda: str(tmp_path / "no"),
            "inplace": lambda: _adapter(tmp_path / "a", 1),
            "empty dir": lambda: str(tmp_path)}[case]()
    lora = LoRARequest("A", 1, path, load_inplace=case == "inplace")
    assert isinstance(chunk_keys(request(base_tokens(), lora=lora), CHUNK), Uncacheable)


def test_extending_incrementally_equals_computing_at_once():
    t = with_image(base_tokens(), 200, 300)
    whole = request(t, images=[("A", 200, 300)], salt="s")
    part = request(t, images=[("A", 200, 300)], salt="s")
    k = RequestKeyer(CHUNK).keys(part, 300)
    assert len(k.hashes) == 1
    assert k.extend(part, 600) == keys_of(whole).hashes[1:2]
    k.extend(part, 600)  # nothing new
    k.extend(part)
    assert k.hashes == keys_of(whole).hashes


def test_decode_tokens_extend_keys_without_rehashing():
    t = base_tokens()[:1000]
    r = request(t)
    keyer = RequestKeyer(CHUNK)
    k = keyer.keys(r)
    assert len(k.hashes) == 3
    for step in range(100):  # decode: one token a step, a new chunk at 1024
        r.append_output_token_ids(step + 3)
        new = k.extend(r)
        assert len(new) == (1 if r.num_tokens == 1024 else 0)
    assert k.hashes == keyer.keys(r).hashes
    # Equal to a prompt of the same tokens.
    assert k.hashes == keyer.keys(request(list(r.all_token_ids))).hashes
    with pytest.raises(ValueError):
        k.extend(r, r.num_tokens + 1)


def test_decode_tokens_after_prompt_embeds():
    e = _embeds()[:1000]
    r = request(None, embeds=e)
    k = keys_of(r)
    for step in range(30):
        r.append_output_token_ids(7)
        k.extend(r)
    assert k.hashes == keys_of(r).hashes and len(k.hashes) == 4


def test_randomised_pairs_agree_with_vllm():
    """Random mutations of one base request: tokens, images, embeds, salt."""
    rng = random.Random(1234)
    t0 = with_image(with_image(base_tokens(), 100, 64), 700, 256)
    imgs0 = [("I1", 100, 64), ("I2", 700, 256)]
    e0 = _embeds()
    for trial in range(60):
        def mutate():
            t, imgs, e, salt = list(t0), list(imgs0), e0.clone(), None
            kind = rng.choice(["tok", "img", "emb", "salt", "none"])
            if kind == "tok":
                t[rng.randrange(N)] += 1
            elif kind == "img":
                i = rng.randrange(2)
                imgs[i] = (imgs[i][0] + "x",) + imgs[i][1:]
            elif kind == "emb":
                e[rng.randrange(N)] += 0.5
            elif kind == "salt":
                salt = "s"
            return request(t, images=imgs, embeds=e, mask=[True] * N, salt=salt)
        check_pair(mutate(), mutate())


def test_uncacheable_requests():
    t = base_tokens()
    assert isinstance(chunk_keys(request(t, images=[("", 10, 5)]), CHUNK), Uncacheable)
    # vLLM's counter-named items (its content hashing off): equal across engines.
    placeholder = request(t, images=[("renderer0-mm-3-image-0", 10, 5)])
    assert isinstance(chunk_keys(placeholder, CHUNK), Uncacheable)
    lora_prefixed = request(t, images=[("A:renderer0-mm-3-image-0", 10, 5)])
    assert isinstance(chunk_keys(lora_prefixed, CHUNK), Uncacheable)
    hashed = request(t, images=[("0f" * 32, 10, 5)])
    assert isinstance(chunk_keys(hashed, CHUNK), RequestKeys)
    assert isinstance(RequestKeyer(CHUNK, mm_content_hashed=False).keys(hashed), Uncacheable)
    assert isinstance(chunk_keys(request(t, pooling=True), CHUNK), Uncacheable)
    assert isinstance(chunk_keys(request(t, resumable=True), CHUNK), Uncacheable)


def test_reset_changes_every_key_and_stops_requests_in_flight():
    t = base_tokens()
    keyer = RequestKeyer(CHUNK)
    waiting, running = request(t), request(t)
    kw, kr = keyer.keys(waiting), keyer.keys(running)
    running.num_computed_tokens = 512
    assert keyer.refresh(kw, waiting) is kw
    keyer.reset()
    fresh = keyer.refresh(kw, waiting)
    assert isinstance(fresh, RequestKeys) and not set(fresh.hashes) & set(kw.hashes)
    assert isinstance(keyer.refresh(kr, running), Uncacheable)
    assert keyer.keys(request(t)).hashes == fresh.hashes


# -- the engine's part of the fingerprint -------------------------------------------------

def _engine_config(model_dir, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                dtype="float32", max_model_len=2048)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

    return save_config(tiny_gemma4_config(), tmp_path_factory.mktemp("model"))


def test_engine_identity_names_what_changes_the_kv(model_dir):
    from gemma4_kv.keys.engine import engine_identity

    base = engine_identity(_engine_config(model_dir))
    assert base.unsafe is None
    assert engine_identity(_engine_config(model_dir)).digest == base.digest
    others = {
        "kv dtype": engine_identity(_engine_config(model_dir, kv_cache_dtype="fp8")),
        "dtype": engine_identity(_engine_config(model_dir, dtype="bfloat16")),
        "overrides": engine_identity(_engine_config(
            model_dir, hf_overrides={"sliding_window": 64})),
        "generation": engine_identity(_engine_config(model_dir), generation="reset-1"),
        "weights id": engine_identity(_engine_config(model_dir), weights_id="ckpt-2"),
    }
    assert len({base.digest} | {i.digest for i in others.values()}) == len(others) + 1
    assert others["kv dtype"].unsafe is None  # per-tensor fp8: static scales, keyed below
    odd = engine_identity(_engine_config(model_dir, kv_cache_dtype="int8_per_token_head"))
    assert odd.unsafe and "int8_per_token_head" in odd.unsafe


def test_model_id_replaces_the_models_path(tmp_path, model_dir):
    import shutil

    from gemma4_kv.keys.engine import engine_identity

    a, b = (shutil.copytree(model_dir, tmp_path / n) for n in ("a", "b"))
    assert engine_identity(_engine_config(a)).digest != engine_identity(_engine_config(b)).digest
    assert engine_identity(_engine_config(a), model_id="gemma").digest == \
        engine_identity(_engine_config(b), model_id="gemma").digest
    assert engine_identity(_engine_config(a), model_id="gemma").digest != \
        engine_identity(_engine_config(a), model_id="other").digest


def test_engine_level_lora_multimodal_and_attention_settings_are_named(model_dir):
    from vllm.config.multimodal import MultiModalConfig

    from gemma4_kv.keys.engine import engine_identity

    def digest(**kw):
        return engine_identity(_engine_config(model_dir, **kw)).digest

    lora = digest(enable_lora=True)
    assert lora != digest()
    assert digest(enable_lora=True, lora_dtype="float16") != lora
    assert digest(enable_lora=True, fully_sharded_loras=True) != lora
    assert digest(enable_lora=True, max_loras=3) == lora  # capacity, not numerics
    assert digest(attention_config={"flash_attn_version": 3}) != digest()

    def with_mm(**kw):
        cfg = _engine_config(model_dir)
        cfg.model_config.multimodal_config = MultiModalConfig(**kw)
        return engine_identity(cfg).digest

    plain = with_mm()
    assert with_mm() == plain
    assert with_mm(mm_processor_kwargs={"do_pan_and_scan": True}) != plain
    assert with_mm(mm_encoder_attn_dtype="fp8") != plain
    assert with_mm(mm_processor_cache_gb=1) == plain  # a cache size: same tower output


def test_layer_identity_covers_backend_dtype_and_kv_scales(model_dir):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    from gemma4_kv.keys.engine import layer_identity

    cfg = _engine_config(model_dir, kv_cache_dtype="fp8")
    name = "model.layers.0.self_attn.attn"
    with set_current_vllm_config(cfg):
        layer = Attention(4, 32, 1.0, num_kv_heads=1, cache_config=cfg.cache_config,
                          prefix=name)
    first, unsafe = layer_identity(cfg, [name])
    assert unsafe is None and layer_identity(cfg, [name])[0] == first
    layer._v_scale.fill_(0.25)  # a checkpoint with other KV scales
    assert layer_identity(cfg, [name])[0] != first
    assert layer_identity(cfg, [name, "model.layers.99.self_attn.attn"])[1]


def test_fingerprint_takes_the_engine_identity():
    from gemma4_kv.tools.harness import tiny_gemma4_config
    from gemma4_kv.layout.from_hf import hf_layout
    from gemma4_kv.keys.engine import fingerprint

    layout = hf_layout(tiny_gemma4_config(), dtype=torch.float32, block_size=32)
    old = fingerprint(layout, model="m", chunk_size=CHUNK)
    assert fingerprint(layout, model="m", chunk_size=CHUNK, engine="", layers="") == old
    a = fingerprint(layout, model="m", chunk_size=CHUNK, engine="e1", layers="l1")
    assert len({old, a, fingerprint(layout, model="m", chunk_size=CHUNK, engine="e2",
                                    layers="l1"),
                fingerprint(layout, model="m", chunk_size=CHUNK, engine="e1",
                            layers="l2")}) == 4
