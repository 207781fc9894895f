"""``torch.compile(model, fullgraph=True)`` on the models (no padding mask): the same outputs as eager. The id-range
checks read the data, so they are skipped while compiling; eager calls still make them."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from sublayer.models import GPT2, Bert, BertConfig, GPT2Config, Transformer
from sublayer.models.transformer import TransformerConfig

V, T = 13, 5


def _models():
    torch.manual_seed(0)
    yield "bert", Bert(BertConfig(vocab_size=V, d_model=6, n_layers=1, n_heads=2, d_ff=7, max_positions=11)), 1
    yield "gpt2", GPT2(GPT2Config(vocab_size=V, d_model=6, n_layers=1, n_heads=2, max_positions=11)), 1
    cfg = TransformerConfig(src_vocab_size=V, tgt_vocab_size=V, d_model=6, n_heads=2, d_ff=7, n_layers=1)
    yield "transformer", Transformer.from_config(cfg), 2


@pytest.mark.parametrize("name, model, n_inputs", list(_models()), ids=["bert", "gpt2", "transformer"])
def test_fullgraph_compile_equals_eager(name, model, n_inputs):
    model.eval()
    ids = [torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(i)) for i in range(n_inputs)]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # the tracing is what is tested
    with torch.no_grad():
        assert_close(compiled(*ids), model(*ids))
        bad = [x.clone() for x in ids]
        bad[0][0, 0] = V
        with pytest.raises(ValueError, match=rf"must lie in \[0, (vocab_size=)?{V}\)"):
            model(*bad)
