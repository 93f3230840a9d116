"""A drafter for engine tests: the target's own greedy continuation, corrupted at random.

Losslessness must hold for *any* drafter, so the engine's exactness tests use one whose proposals are
often right and sometimes wrong, with a sparse draft distribution it really samples from. It implements
the same protocol as the real drafters (dspark_core.drafters.base) and runs the real target model.
"""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from dspark_core.drafters.base import LocalStates, Proposal


class OracleDrafter(LocalStates):
    name, kind = "oracle", "test"
    target_layer_ids: tuple[int, ...] = ()
    has_confidence = True

    def __init__(self, model_dir, block_size=4, corrupt=0.3, support_size=4, seed=0):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.block_size, self.corrupt, self.support_size = block_size, corrupt, support_size
        self.rng = random.Random(seed)

    def new_state(self):
        return {"tokens": []}

    @torch.no_grad()
    def _greedy(self, ids, n):
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    def propose(self, items):
        proposals = []
        for it in items:
            it.state["tokens"].extend(it.new_tokens)
            truth = self._greedy(it.state["tokens"] + [it.anchor], self.block_size)
            toks, ids, probs, confs = [], [], [], []
            for t in truth:
                # sampled requests draw everything from their own generator, so runs are reproducible
                if it.temperature > 0:
                    perm = torch.randperm(self.vocab_size - 1, generator=it.generator)[: self.support_size - 1]
                    others = [int(v) + (int(v) >= t) for v in perm]
                else:
                    others = self.rng.sample([v for v in range(self.vocab_size) if v != t], self.support_size - 1)
                support = torch.tensor([t, *others])
                q = torch.tensor([1 - self.corrupt] + [self.corrupt / len(others)] * len(others))
                if it.temperature == 0:
                    tok = others[0] if self.rng.random() < self.corrupt else t
                else:
                    tok = int(support[torch.multinomial(q, 1, generator=it.generator)])
                toks.append(tok)
                ids.append(support)
                probs.append(q)
                confs.append(self.rng.uniform(0.2, 0.95))
            sampled = it.temperature > 0
            proposals.append(Proposal(tokens=toks, support_ids=torch.stack(ids) if sampled else None,
                                      support_probs=torch.stack(probs) if sampled else None,
                                      confidences=torch.tensor(confs)))
        return proposals
