"""`strop model import`: a local Hugging Face directory (or GGUF file) as a policy directory every
stage loads; one line and exit 2 where the model's package or the extra is missing. The packaged
SmolLM2 GGUF itself is imported by the slow tier's `smollm2_dir` fixture."""

import json

import pytest

from strop.cli import main


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory, tiny_tokenizer):
    """A tiny random Llama saved by transformers itself, with strop's tokenizer and chat template."""
    from tests.test_dense_engine import tiny_llama

    path = tmp_path_factory.mktemp("hf-llama")
    tiny_llama(len(tiny_tokenizer)).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_imports_a_hf_directory_into_out(hf_source, tmp_path, capsys):
    from strop.data.tokenizer import load_tokenizer
    from strop.model.policy import load_model

    out = tmp_path / "model"
    assert main(["model", "import", str(hf_source), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    model, tok = load_model(out), load_tokenizer(out)
    assert type(model).__name__ == "LlamaForCausalLM" and tok.chat_template
    assert json.loads((out / "strop.json").read_text())["imported_from"] == str(hf_source)
    assert main(["model", "import", str(hf_source), "--out", str(out)]) == 0  # its own output: replaced whole
    assert not out.with_name("model.tmp").exists() and not out.with_name("model.old").exists()


def test_imports_once_into_the_node_cache(hf_source, capsys):
    assert main(["model", "import", str(hf_source)]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["model", "import", str(hf_source)]) == 0
    assert capsys.readouterr().out.strip() == first and "/models/" in first


@pytest.mark.parametrize(
    "argv, says",
    [
        (["model", "import", "/nonexistent/model.gguf"], "does not exist"),
        (["model", "import", "{tmp}/file.txt"], "a .gguf file or a Hugging Face model directory"),
        (["model", "import", "{tmp}"], "not a Hugging Face model directory"),
    ],
)
def test_bad_sources_are_one_line_and_exit_2(argv, says, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_refuses_to_replace_a_directory_it_did_not_write(hf_source, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert main(["model", "import", str(hf_source), "--out", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_without_the_package_one_line_names_the_extra(monkeypatch, capsys):
    from strop.model import importer

    monkeypatch.setattr(importer, "PACKAGE", "llm-no-such-model-package")
    assert main(["model", "import"]) == 2
    err = capsys.readouterr().err
    assert "make smol" in err and "llm-no-such-model-package" in err and err.count("\n") == 1


def test_gguf_without_the_extra_names_it(monkeypatch, tmp_path, capsys):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find(name, *a))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert main(["model", "import", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "gguf" in err and "make smol" in err and err.count("\n") == 1
