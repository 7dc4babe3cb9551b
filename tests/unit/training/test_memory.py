"""Per-token log-probs never materialise [tokens x vocab] logits.

Every tensor any operator creates during the update's forward and backward is recorded; the
largest must stay far below tokens x vocab. TRL's kernel works in tiles (4,096 tokens x 32,768
vocabulary entries by default), so its working memory does not grow with trajectory length; the
test shrinks the tiles to keep the check fast while exercising the same code path.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl.trainer.utils import add_fused_lm_head

from loop_trainer.objective import loop_policy_loss
from loop_trainer.training.batching import TrainingSample, collate
from loop_trainer.training.logprobs import token_logprobs


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


def test_update_never_holds_a_tokens_by_vocab_tensor(monkeypatch):
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as trl_utils

    assert kernel.TOKEN_CHUNK_SIZE == 4096 and trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == 32768
    monkeypatch.setattr(kernel, "TOKEN_CHUNK_SIZE", 256)
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 2048)
    torch.manual_seed(0)
    tokens, vocab = 2048, 16_000
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    add_fused_lm_head(model)
    ids = torch.randint(0, vocab, (tokens,)).tolist()
    sample = TrainingSample(ids, [0] * 512 + [1] * (tokens - 512), [0.0] * tokens, 1.0, False)
    batch = collate([sample], 0)
    with LargestTensor() as largest:
        logprobs = token_logprobs(model, batch)
        out = loop_policy_loss(logprobs, logprobs.detach() - 0.01, batch.advantages, batch.loss_mask)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    assert model.model.embed_tokens.weight.grad is not None
    assert largest.numel <= 256 * 2048 < tokens * vocab / 25, largest.numel
