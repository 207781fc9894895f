"""``sublayer.text``: Encoder and TextGenerator on tiny HF folders with tokenizers built in the test (a WordLevel
``tokenizer.json`` as written, and a byte-level BPE saved with its ``tokenizer_config.json``, read by
``AutoTokenizer``): results equal the model calls on the tokenizer's ids; streamed pieces join to ``generate``'s
text; bad inputs are named."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from sublayer.models import GPT2, Bert  # noqa: E402
from sublayer.text import Encoder, TextGenerator, load_tokenizer  # noqa: E402
from tests.conftest import reference_decoding  # noqa: E402
from tests.models.conftest import make_hf_bert, make_hf_gpt2, word_tokenizer  # noqa: E402

TEXTS = ["the cat sat on a mat", "hello world", "big dog", "the quick brown fox jumps over the lazy dog", "sun"]
CORPUS = ["héllo wörld, naïve café ☕ — the quick brown fox", "über straße façade 日本語 the lazy dog"] * 20


def byte_bpe():
    """A byte-level BPE over :data:`CORPUS` with few merges: accented letters and symbols span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def word_gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text_gpt2")
    make_hf_gpt2().save_pretrained(folder)
    word_tokenizer().save(str(folder / "tokenizer.json"))  # tokenizer.json only: read as written
    return folder


@pytest.fixture(scope="module")
def bpe_gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text_bpe")
    tok = byte_bpe()
    make_hf_gpt2(vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text_bert")
    make_hf_bert().save_pretrained(folder)
    specials = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(bert=True), **specials)
    fast.save_pretrained(folder)
    return folder


# ---- Encoder ---------------------------------------------------------------------------------------------------


def test_encode_equals_the_models_embed_one_by_one_in_input_order(bert_dir):
    enc = Encoder.from_pretrained(bert_dir)
    got = enc.encode(TEXTS, batch_size=2)
    assert got.shape == (len(TEXTS), 15)
    model = Bert.from_pretrained(bert_dir)
    tok = word_tokenizer(bert=True)
    for text, vec in zip(TEXTS, got):
        want = model.embed(torch.tensor([tok.encode(text).ids]))[0]
        assert_close(vec, want, rtol=1e-5, atol=1e-6)
        assert_close(enc.encode(text), vec, rtol=1e-5, atol=1e-6)  # a str -> one vector
    assert_close(enc.encode(TEXTS, batch_size=len(TEXTS)), got, rtol=1e-5, atol=1e-6)
    assert enc.encode([]).shape == (0, 15)


def test_encode_sorts_batches_by_length(bert_dir):
    enc = Encoder.from_pretrained(bert_dir)
    seen = []
    forward = enc.model.forward
    enc.model.forward = lambda ids, *a: seen.append(ids.shape) or forward(ids, *a)
    enc.encode(TEXTS, batch_size=2)
    assert seen == [(2, 11), (2, 4), (1, 3)]  # token counts 8, 4, 4, 11, 3 (with [CLS] [SEP])  # longest first: little padding per batch


def test_encode_normalize_and_progress_bar(bert_dir, capsys):
    enc = Encoder.from_pretrained(bert_dir)
    raw = enc.encode(TEXTS, normalize=False, show_progress_bar=True)
    assert "Batches" in capsys.readouterr().err
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(len(TEXTS)))
    assert_close(torch.nn.functional.normalize(raw, dim=-1), enc.encode(TEXTS))


def test_encode_equals_sentence_transformers(bert_dir, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers import models

    modules = [models.Transformer(str(bert_dir), max_seq_length=7)]
    modules += [models.Pooling(15, pooling_mode="mean"), models.Normalize()]
    st.SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path))
    want = st.SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS, convert_to_tensor=True, batch_size=2)
    got = Encoder.from_pretrained(tmp_path).encode(TEXTS, batch_size=2)  # max_seq_length=7 truncates too
    assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pooling, normalize", [("cls", True), ("mean", False)])
def test_encode_follows_the_sentence_transformers_pooling_and_normalize(bert_dir, tmp_path, pooling, normalize):
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers import models

    modules = [models.Transformer(str(bert_dir)), models.Pooling(15, pooling_mode=pooling)]
    modules += [models.Normalize()] if normalize else []
    st.SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path))
    want = st.SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS, convert_to_tensor=True, batch_size=2)
    got = Encoder.from_pretrained(tmp_path).encode(TEXTS, batch_size=2)
    assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_sentence_transformers_folder_encode_cannot_follow_is_refused(bert_dir, tmp_path):
    import shutil

    folder = tmp_path / "st"
    shutil.copytree(bert_dir, folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"1_Pooling/config.json: pooling mode 'max'; Encoder pools with mean or cls"):
        Encoder.from_pretrained(folder)
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')  # older files' flags
    assert Encoder.from_pretrained(folder).pooling == "cls"
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"modules.json: module 'sentence_transformers.models.Dense' \(path '2_Dense'\)"):
        Encoder.from_pretrained(folder)


def test_encode_int8_and_bf16(bert_dir):
    f32 = Encoder.from_pretrained(bert_dir).encode(TEXTS)
    for enc in (Encoder.from_pretrained(bert_dir, quantize="int8"), Encoder.from_pretrained(bert_dir, dtype=torch.bfloat16)):
        assert float((enc.encode(TEXTS) * f32).sum(-1).min()) > 0.99


def test_encode_errors(bert_dir, word_gpt2, tmp_path):
    enc = Encoder.from_pretrained(bert_dir)
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got int"):
        enc.encode(["a", 3])
    with pytest.raises(TypeError, match="texts must be a str or a list of str, got int"):
        enc.encode(5)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        enc.encode(TEXTS, batch_size=0)
    with pytest.raises(ValueError, match="model_type must be 'bert' for BERT, got 'gpt2'"):
        Encoder.from_pretrained(word_gpt2)
    with pytest.raises(ValueError, match="quantize must be None or one of 'int8', got 'int4'"):
        Encoder.from_pretrained(bert_dir, quantize="int4")
    make_hf_bert().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"embed needs a tokenizer file, but {tmp_path / 'tokenizer.json'}"):
        Encoder.from_pretrained(tmp_path)


def test_a_sentence_transformers_config_that_is_not_an_object_is_named(bert_dir, tmp_path):
    import shutil

    folder = tmp_path / "st"
    shutil.copytree(bert_dir, folder)
    (folder / "sentence_bert_config.json").write_text("[128]")
    with pytest.raises(ValueError, match=r"sentence-transformers config .*sentence_bert_config.json must hold a JSON "
                                         r"object, got list"):  # fmt: skip
        Encoder.from_pretrained(folder)
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 5}')
    assert Encoder.from_pretrained(folder).max_length == 5


def test_bad_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot read tokenizer file {tmp_path / 'tokenizer.json'}"):
        load_tokenizer(tmp_path)


def test_without_transformers_the_error_names_it(bert_dir):
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ModuleNotFoundError(name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from sublayer.text import load_tokenizer\n"
        "try:\n    load_tokenizer(sys.argv[1])\n"
        "except ModuleNotFoundError as e:\n    print(e.name, '|', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(bert_dir)], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == (
        "transformers | reading a folder's tokenizer needs 'transformers': pip install transformers"
    ), proc.stderr


# ---- TextGenerator ---------------------------------------------------------------------------------------------


def _want(folder, tok, prompt: str, n: int, **kw) -> str:
    """The reference: the model's generate on the tokenizer's ids, cut at eos, decoded with the prompt."""
    model = GPT2.from_pretrained(folder)
    ids = tok(prompt)["input_ids"]
    new = model.generate(torch.tensor([ids]), n, **kw)[0, len(ids) :].tolist()
    eos = model.generation_config.eos_token_id
    new = new[: new.index(eos)] if eos in new else new
    return tok.decode(ids + new)[len(tok.decode(ids)) :]


@pytest.mark.parametrize("kind", ["word", "bpe"])
def test_generate_equals_the_model_on_the_tokenizers_ids(word_gpt2, bpe_gpt2, kind):
    folder = word_gpt2 if kind == "word" else bpe_gpt2
    gen = TextGenerator.from_pretrained(folder)
    prompt = "the quick brown fox" if kind == "word" else "héllo wörld"
    want = _want(folder, gen.tokenizer, prompt, 9)
    assert gen.generate(prompt, max_new_tokens=9) == prompt + want
    assert gen.generate(prompt, max_new_tokens=9, return_full_text=False) == want
    prompts = [prompt, "the lazy dog", "sun"]
    batch = gen.generate(prompts, max_new_tokens=6)  # one left-padded batch
    assert batch == [gen.generate(p, max_new_tokens=6) for p in prompts]
    assert gen.generate([]) == []


def test_generate_defaults_come_from_generation_config(word_gpt2, tmp_path):
    import shutil

    shutil.copytree(word_gpt2, tmp_path / "g")
    (tmp_path / "g" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    gen = TextGenerator.from_pretrained(tmp_path / "g")
    text = gen.generate("the cat", return_full_text=False)
    assert len(text.split()) == 4  # 4 words (no eos set by the file: HF's rule)
    assert len(gen.generate("the cat", return_full_text=False, max_new_tokens=2).split()) == 2
    (tmp_path / "g" / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 3}))
    gen = TextGenerator.from_pretrained(tmp_path / "g")
    a = gen.generate("the cat", generator=torch.Generator().manual_seed(1))
    assert a == gen.generate("the cat", generator=torch.Generator().manual_seed(1))
    assert {gen.generate("the cat", generator=torch.Generator().manual_seed(s)) for s in range(4)} != {a}


@pytest.mark.parametrize("loop", ["fast", "reference"])
@pytest.mark.parametrize("kind", ["word", "bpe"])
def test_stream_pieces_join_to_generate(word_gpt2, bpe_gpt2, loop, kind):
    folder = word_gpt2 if kind == "word" else bpe_gpt2
    gen = TextGenerator.from_pretrained(folder)
    prompt = "the quick brown fox" if kind == "word" else "naïve café"

    def run():
        return list(gen.stream(prompt, max_new_tokens=12))

    pieces = run() if loop == "fast" else reference_decoding(run)
    assert len(pieces) > 1 and "".join(pieces) == gen.generate(prompt, max_new_tokens=12, return_full_text=False)
    sampled = list(gen.stream(prompt, max_new_tokens=12, do_sample=True, generator=torch.Generator().manual_seed(5)))
    want = gen.generate(prompt, max_new_tokens=12, do_sample=True, generator=torch.Generator().manual_seed(5),
                        return_full_text=False)  # fmt: skip
    assert "".join(sampled) == want


class _Scripted:
    """A model whose generate streams fixed tokens (to test the streamer's text pieces exactly)."""

    def __init__(self, tokens, eos):
        from sublayer.checkpoints import GenerationConfig

        self.tokens, self.generation_config = tokens, GenerationConfig(eos_token_id=eos)

    def generate(self, ids, *, streamer, **options):
        streamer.put(ids)
        for t in self.tokens:
            streamer.put(torch.tensor([t]))
        streamer.end()


def test_stream_holds_back_incomplete_characters(bpe_gpt2):
    tok = load_tokenizer(bpe_gpt2)
    text = "ü☕日本"
    ids = tok(text)["input_ids"]
    assert len(ids) > len(text)  # characters span several tokens
    gen = TextGenerator(_Scripted([*ids, 0, *ids], eos=0), tok)
    pieces = list(gen.stream("the"))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)  # stops at the eos id 0
    assert len(pieces) >= 3  # one piece per token that completes characters


class _Slow(_Scripted):
    """Streams its tokens 50 ms apart, counting those the streamer took."""

    def generate(self, ids, *, streamer, **options):
        streamer.put(ids)
        self.made = 0
        for t in self.tokens:
            streamer.put(torch.tensor([t]))
            self.made += 1
            time.sleep(0.05)
        streamer.end()


def test_leaving_a_stream_early_stops_decoding(word_gpt2):
    model = _Slow([4, 5, 6, 7] * 10, eos=None)
    it = TextGenerator(model, load_tokenizer(word_gpt2)).stream("the")
    assert next(it) == " the"
    it.close()  # the next token's put stops the decoding thread, which close() joins
    assert model.made < 5


def test_generate_errors(word_gpt2, bert_dir, tmp_path):
    gen = TextGenerator.from_pretrained(word_gpt2)
    with pytest.raises(TypeError, match="prompt must be a str .*got list"):
        gen.stream(["a", "b"])
    with pytest.raises(TypeError, match=r"prompt\[0\] must be a str, got int"):
        gen.generate([1])
    with pytest.raises(ValueError, match="the prompt '' encodes to no tokens"):
        gen.generate("")
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 2"):
        list(gen.stream("the cat", top_p=2.0, do_sample=True))  # option errors come out of the iterator
    with pytest.raises(ValueError, match="max_length must be an int > the prompt length 2"):
        gen.generate("the cat", max_length=2)
    msg = f"model {str(bert_dir)!r} has model_type 'bert' in config.json: generate supports gpt2, llama, qwen2"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        TextGenerator.from_pretrained(bert_dir)
    with pytest.raises(ValueError, match="has no tokenizer: pass tokenizer="):
        TextGenerator(gen.model).generate("the cat")
    make_hf_gpt2().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="a text prompt needs a tokenizer file"):
        TextGenerator.from_pretrained(tmp_path).generate("the cat")
    assert TextGenerator.from_pretrained(tmp_path).model.generate(torch.tensor([[5, 6]]), 2).shape == (1, 4)
