"""PEFT's input casts are switched off for the update where autocast makes them redundant: the
loss and every gradient stay bitwise the same (checkpointed recomputation included), with fewer
copies; without autocast nothing is switched."""

from __future__ import annotations

import contextlib

import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from loop_trainer.training.adapter_casts import adapter_input_casts_off


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def _policy(vault_tiny):
    env, model, tok = vault_tiny
    model = model.to(torch.bfloat16)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config)  # PEFT's default: a float32 adapter on the bf16 weights
    policy.gradient_checkpointing_enable({"use_reentrant": False})
    policy.enable_input_require_grads()
    policy.train()
    return policy


def _loss_and_grads(policy, autocast, casts_off: bool):
    policy.zero_grad(set_to_none=True)
    ids = torch.arange(3, 40).reshape(1, -1)
    counter = CountCopies()
    switched = adapter_input_casts_off(policy, autocast) if casts_off else contextlib.nullcontext(0)
    with switched as count, counter:
        with autocast():
            logits = policy(input_ids=ids).logits
        loss = torch.log_softmax(logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None]).mean()
        loss.backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.copies, count


def test_under_autocast_the_update_is_bitwise_the_same_with_fewer_copies(vault_tiny):
    policy = _policy(vault_tiny)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    loss, grads, copies, _ = _loss_and_grads(policy, autocast, casts_off=False)
    loss_off, grads_off, copies_off, switched = _loss_and_grads(policy, autocast, casts_off=True)
    layers = sum(1 for name, _ in policy.named_modules() if name.endswith("lora_A"))
    assert switched == layers > 0
    assert torch.equal(loss, loss_off)
    assert grads.keys() == grads_off.keys() and len(grads) == 2 * layers  # the adapter's A and B
    for name in grads:
        assert torch.equal(grads[name], grads_off[name]), name
    # forward, recomputation and backward each drop a cast per layer
    assert copies - copies_off >= 3 * layers
    assert all(layer.cast_input_dtype_enabled for layer in _tuner_layers(policy))  # restored after


def test_without_autocast_nothing_is_switched(vault_tiny):
    policy = _policy(vault_tiny)
    with adapter_input_casts_off(policy, contextlib.nullcontext) as switched:
        assert switched == 0 and all(layer.cast_input_dtype_enabled for layer in _tuner_layers(policy))
        policy(input_ids=torch.arange(3, 10).reshape(1, -1))  # a float32 adapter still gets float32 inputs


def _tuner_layers(policy):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module for module in policy.modules() if isinstance(module, BaseTunerLayer)]
