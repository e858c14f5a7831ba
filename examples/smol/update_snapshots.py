"""Two real consecutive versions of SmolLM2 for `strop bench sync --demo-run`: version 0 is the
imported model rounded to bf16 (as a weight store holds it), version 1 that model after one AdamW
step on a few hundred tokens of this repository's README. Two pairs, each a directory of two bf16
safetensors snapshots:

  OUT/lr3e-4  lr 3e-4, the embeddings and the lower 2/3 of the layers frozen (`strop online
              --simulate`'s update of a pretrained model: a dense change of the trained layers)
  OUT/lr1e-6  lr 1e-6, every layer trained (an RL learning rate: a sparse change)

    python examples/smol/update_snapshots.py "$(strop model import)" OUT
    strop bench sync --quick --no-fanout --demo-run OUT/lr3e-4
"""

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from strop.online.sim_policy import round_to_bf16
from strop.train.device import freeze_lower

PAIRS = {"lr3e-4": (3e-4, 2 / 3), "lr1e-6": (1e-6, 0.0)}  # dir -> (lr, frozen fraction of the layers)
TOKENS = 512


def snapshot(model, path: Path) -> None:
    # tied weights share storage; safetensors wants each saved once, and a copy of each is what a store holds
    save_file({k: v.detach().to(torch.bfloat16).contiguous().clone() for k, v in model.state_dict().items()}, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a policy directory (`strop model import` prints one)")
    p.add_argument("out", help="directory for the pairs")
    args = p.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    text = (Path(__file__).parents[2] / "README.md").read_text()
    ids = torch.tensor([tok.encode(text)[:TOKENS]])
    for name, (lr, frozen) in PAIRS.items():
        out = Path(args.out) / name
        os.makedirs(out, exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        round_to_bf16(model)
        snapshot(model, out / "00000000.safetensors")
        n = freeze_lower(model, frozen)
        # the RL trainer's optimizer (strop.rl.trainer)
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=lr, betas=(0.9, 0.95))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        snapshot(model, out / "00000001.safetensors")
        layers = len(model.model.layers)
        print(f"{out}: one AdamW step at lr {lr:g} on {ids.shape[1]} tokens, {n} of {layers} layers frozen")


if __name__ == "__main__":
    main()
