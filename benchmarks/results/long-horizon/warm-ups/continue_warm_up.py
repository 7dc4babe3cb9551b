"""Continue a kept warm start's supervised warm-up (fresh AdamW, same demonstrations and held-out set) for a
fixed number of steps without a stop, reporting held-out reply accuracy. Usage: cont.py SEED START OUT STEPS"""
import sys, time
from transformers import AutoModelForCausalLM, AutoTokenizer
from loop_trainer.envs.errands import ErrandsEnv
from loop_trainer.models import tiny
seed, start, out, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
env = ErrandsEnv(num_tasks=64, levels=[1, 2, 3])
tok = tiny.load_tokenizer(start)
model = AutoModelForCausalLM.from_pretrained(start)
fit = tiny.FitRule(window=10**6, max_steps=steps, min_passes=0)
conv = tiny.replay_demonstrations(env, fit.conversations, seed, 3600)
held = tiny.replay_demonstrations(env, fit.held_out_conversations, seed + 1, 600)
print("held-out accuracy at start", tiny.reply_accuracy(model, [tiny._assistant_masked_ids(tok, m) for m in held]), flush=True)
t = time.time()
tiny.warm_start(model, tok, conv, steps=None, held_out=held, fit=fit, seed=seed + 1000, label=f"cont-s{seed}", report=lambda s: print(s, flush=True))
print("seconds", time.time() - t, flush=True)
model.save_pretrained(out); tok.save_pretrained(out)
