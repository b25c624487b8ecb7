"""A tiny, randomly initialised Qwen2-style model with a byte-level tokenizer.

Built entirely offline (no hub access) so tests, benchmarks and examples can
run a *real* causal LM end to end: real tokens, real logprobs, real KV cache.

The tokenizer maps each byte to one token (byte-level BPE with no merges) and
adds Qwen's chat markers as special tokens, so any text round-trips exactly.
The chat template follows Qwen2.5's layout, including ``tools`` in the system
prompt, ``<tool_call>`` blocks for assistant tool calls and ``<tool_response>``
blocks for tool results, which is what the hermes tool parser expects.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens, as in Qwen: they stay visible in decoded text.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# A thinking tokenizer's reasoning markers: added (non-special) tokens, as in Qwen3.
THINK_TOKENS = ["<think>", "</think>"]

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call functions. Signatures are within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, answer with <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role in ['user', 'system'] %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if loop.first and not message.content %}{{- '\\n' }}{%- else %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


# A Qwen3-style thinking template (written for these tests): the Qwen2.5 layout above, and
# an assistant reply as ``<think>\nR\n</think>\n\nA`` when it is after the last user message
# (an agent's tool loop), or just ``A`` when a later user message follows (earlier turns'
# reasoning is dropped from the history). The reasoning is ``reasoning_content`` or, when the
# content holds ``</think>``, what the content has before it. ``enable_thinking=False`` puts an
# empty think block in the generation prompt.
THINKING_CHAT_TEMPLATE = (
    CHAT_TEMPLATE.replace(
        """{%- for message in messages %}""",
        """{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}""",
        1,
    )
    .replace(
        """{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}""",
        """{%- set content = message.content or '' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}{%- endif %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant' }}
{%- if loop.index0 > ns.last_query %}{{- '\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n' }}{%- endif %}
{%- if content %}{{- '\\n' + content }}{%- endif %}""",
        1,
    )
    .replace(
        """{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}""",
        """{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}""",
        1,
    )
)
assert THINKING_CHAT_TEMPLATE.count("<think>") == 3, "the base template changed"


def build_tiny_tokenizer(
    *, thinking: bool = False, merges_corpus: Sequence[str] = (), vocab_size: int = 2048
) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens + chat specials, no merges.

    ``thinking``: the think markers are added tokens and the template is
    ``THINKING_CHAT_TEMPLATE`` (a Qwen3-style reasoning model).
    ``merges_corpus``: byte-pair merges learned from these texts, up to
    ``vocab_size`` tokens (any text still round-trips, byte by byte at worst):
    prompts of thousands of bytes (an agent harness's) become a few hundred
    tokens, which a test can teach the model on CPU.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    if merges_corpus:
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False
        )
        backend.train_from_iterator(list(merges_corpus), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens(
        [t for t in SPECIAL_TOKENS if t not in tokenizer.get_vocab()], special_tokens=True
    )
    tokenizer.add_tokens(ADDED_TOKENS + (THINK_TOKENS if thinking else []), special_tokens=False)
    tokenizer.chat_template = THINKING_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_position_embeddings: int = 2048,
    thinking: bool = False,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    merges_corpus: Sequence[str] = (),
) -> Path:
    """Write a tiny random Qwen2ForCausalLM + tokenizer to ``path`` (HF layout)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(thinking=thinking, merges_corpus=merges_corpus)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_layers,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "proxima_tiny.json").write_text(json.dumps({"seed": seed, "kind": "tiny-qwen2-bytes"}))
    return path
