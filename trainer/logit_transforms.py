"""Completions sampled from a transformed distribution: context, not loss tokens.

A request may change the distribution its tokens are drawn from beyond
temperature and top-p/k/min-p truncation: a grammar (structured output,
forced tool calls), ``logit_bias``, frequency/presence penalties. The backend
(SGLang, and the embedded engine alike: ``proxy/embedded/logits.py``) then
samples from, and reports the logprob of, the transformed distribution. For a
grammar mask ``m_s`` (1 on the tokens allowed in state ``s``)::

    q(y | s) = pi(y | s) * m_s(y) / Z(s),      Z(s) = sum_v pi(v | s) * m_s(v)
    b        = log q_behav(y | s) = log pi_behav(y | s) - log Z_behav(s)

The trainer recomputes ``p = log pi_prox(y | s)`` and ``l = log pi(y | s)``
from the plain model: it knows neither the grammar's state nor the
penalties. The decoupled-PPO weight of ``trainer/loss.py`` would be::

    w = exp(p - b) = pi_prox(y | s) / pi_behav(y | s) * Z_behav(s)

off by the factor ``Z_behav(s) <= 1`` (the allowed mass, often tiny: see
``test_constrained_logprobs_are_those_of_the_masked_distribution``), and the
gradient of ``l`` lacks the ``-grad log Z(s)`` term of the policy that was
actually sampled. Such a token would train on a wrong importance ratio.

So the proxy records what transformed each completion
(``CompletionRecord.sampling["logit_transforms"]``, e.g. ``["grammar:json_schema"]``).
A completion whose only transform is a grammar, recorded with it
(``CompletionRecord.grammar``), trains on the constrained distribution: the trainer
replays the grammar's mask and computes ``log q`` itself (``trainer/constrained.py``).
Every other transformed completion (``logit_bias``, penalties, a reasoning budget's
forced tokens, a grammar recorded without its text) stays *context* (loss mask 0),
never loss tokens. Its turn still counts in the session's returns: the reward of a
session that ended with such an answer still reaches its earlier turns.

Where this departs from training every sampled token:

1. Penalised or biased turns carry no policy gradient of their own.
2. Training them on the transformed policy would need the trainer to replay the
   penalties (token counts) and biases over every sequence to recompute ``log Z``
   under the proximal and current weights; it is implemented for grammars only.
"""

from __future__ import annotations

from proxima.proxy.store.records import CompletionRecord


def logit_transforms(completion: CompletionRecord) -> list[str]:
    """What transformed the distribution ``completion`` was sampled from ([] for none)."""
    transforms = completion.sampling.get("logit_transforms") or []
    return [str(t) for t in transforms]


def behaviour_logprobs_reproducible(completion: CompletionRecord) -> bool:
    """Whether the trainer's recomputed logprobs describe the same distribution as ``b``."""
    return not logit_transforms(completion)
