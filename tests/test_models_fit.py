"""A tiny model of each architecture fits a short real text: the loss falls by at least half in a few
hundred CPU steps. The text is the standard library's own documentation, tokenized with cl100k and
re-indexed to the ids it uses so the head stays small."""
import pytest
import torch

from data_pipeline.tokenizer import get_tokenizer
from models import build_model


def short_real_text_ids(n_tokens: int = 1000) -> tuple[torch.Tensor, int]:
    import pydoc_data.topics as topics
    text = topics.topics["assignment"] + topics.topics["for"]
    ids = get_tokenizer().encode_ordinary(text)[:n_tokens]
    uniq = sorted(set(ids))
    remap = {t: i for i, t in enumerate(uniq)}
    return torch.tensor([remap[t] for t in ids]), len(uniq)


@pytest.mark.parametrize("arch", ["llama", "tnl", "hgrn2", "cos2"])
def test_tiny_model_fits_real_text(arch):
    torch.manual_seed(0)
    ids, vocab = short_real_text_ids()
    model = build_model(arch, "tiny", vocab_size=vocab, d_model=64, n_heads=2, d_glu=192)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    seq, batch = 48, 8
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(120):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s:s + seq + 1] for s in starts.tolist()])
        loss = model(x[:, :-1], targets=x[:, 1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert last < first / 2, f"{arch}: loss {first:.3f} -> {last:.3f}"
