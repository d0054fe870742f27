"""The embedded model's tokenizer: a real byte-level BPE, trained here, deterministically.

The serving stack must run on a machine with no network, so we cannot download a tokenizer. We
train a small one (1024 tokens) with the ``tokenizers`` library on a corpus written into this file.
It is shaped like Llama 3's: the same pre-tokenizer split, the 256-symbol byte-level alphabet (so
every UTF-8 string round-trips exactly), special tokens after the learned vocabulary, a
post-processor that prepends BOS, and a Llama-3 style chat template.

Training is deterministic: BPE ties are broken by token id and ids are assigned in a fixed order,
so the same ``tokenizer.json`` bytes come out of every run (tests check it across processes).
This module needs ``tokenizers`` only, no torch.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"  # ends one chat turn; generation stops on it as on EOS
PAD_TOKEN = "<|pad|>"

# Appended after the learned vocabulary, in this order (as Llama 3 places its specials last).
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN, PAD_TOKEN)

VOCAB_SIZE = 1024  # learned tokens (256 bytes + merges) plus the specials


def special_token_id(token: str) -> int:
    """Id of a special token, known without training: the specials are the last ids, in order."""
    return VOCAB_SIZE - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(token)

# Llama 3's pre-tokenizer split: contractions, words with one leading non-letter, numbers of up to
# three digits, punctuation runs, newlines, and whitespace (the last space stays with the next word).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen's: the same, except that every digit is a piece of its own.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

Flavor = Literal["llama3", "qwen2"]

# Llama 3 style: BOS once at the start, then one header-wrapped block per message, each closed by
# <|eot_id|>. Content is either a string or OpenAI-style parts ({"type": "text", "text": ...}).
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unsupported role ' ~ message['role'] ~ ': use system, user or assistant') }}
    {%- endif %}
    {%- if message['content'] is string %}
        {%- set content = message['content'] %}
    {%- else %}
        {%- set content = namespace(text='') %}
        {%- for part in message['content'] %}
            {%- if part['type'] != 'text' %}
                {{- raise_exception('only text content parts are supported, got ' ~ part['type']) }}
            {%- endif %}
            {%- set content.text = content.text ~ part['text'] %}
        {%- endfor %}
        {%- set content = content.text %}
    {%- endif %}
    {{- '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\\n\\n' ~ content | trim ~ '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# The training text. Varied on purpose: prose, dialogue, code, numbers, punctuation, several
# scripts and emoji, so that the learned merges cover what tests and demos feed the model.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving runtime takes requests, turns text into
tokens, runs the model one step at a time, and turns the tokens back into text for the client.
Every request ends with exactly one final answer, even when the prompt is too long or the client
goes away before the answer is ready. When the queue is full, the server says so at once.

In the morning the market opened early. Farmers brought apples, pears, plums and cherries; bakers
brought bread that was still warm. People talked about the weather, the price of coffee, the new
bridge over the river, and the football match that had ended in a draw on Saturday evening.

"Where are you going?" she asked. "To the library," he said, "I have to return three books before
they close at six o'clock." She laughed. "You said that yesterday, and the day before that!"
They walked together down the street, past the school, the station and the little park with its
old trees, until they reached the corner where the road turns toward the hills.

Science is a way of asking questions about the world and testing the answers. A good experiment
changes one thing at a time, measures the result carefully, and can be repeated by someone else.
Water boils at 100 degrees Celsius at sea level; light travels about 299,792 kilometres per second;
the Earth goes around the Sun once every 365.25 days. Numbers like 3.14159, 2.71828 and 1.41421
appear again and again in mathematics, physics, engineering and computer science.

History is full of people who built things: roads, ships, cathedrals, machines and languages.
Some of them wrote down what they learned, and because they did, we can read it today. Reading
and writing are among the oldest technologies we have, older than the wheel in some places.

Questions and answers:
Q: What is the capital of France? A: Paris.
Q: How many days are there in a week? A: Seven.
Q: What is 12 times 12? A: 144.
Q: Who wrote the play about the prince of Denmark? A: William Shakespeare.
Q: Which is larger, the Moon or the Earth? A: The Earth is larger than the Moon.

User: Can you help me write a short poem about the sea?
Assistant: Of course. Here is one:
  The sea is grey, the sea is wide,
  it keeps its secrets deep inside;
  it sings at night, it shines by day,
  and carries all our boats away.
User: Thank you! That is lovely.
Assistant: You are welcome. Let me know if you would like another one.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]

for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

{"name": "example", "version": "1.0.0", "tokens": [1, 2, 3], "ok": true, "value": null}
SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 20;
https://example.com/path/to/page?query=value&lang=en#section-2
user@example.org, +1 (555) 010-2030, 2024-06-01T12:30:00Z, $19.99, 50% off, #hashtag, @mention
Dates and times: 01/02/2003, 10:45 pm, 1999, 2000, 2025, 1st, 2nd, 3rd, 4th, 100th.
Punctuation: . , ; : ! ? ' " ( ) [ ] { } < > / \\ | - _ + = * & ^ % $ # @ ~ ` ... -- ;-) :-)

Le renard brun saute par-dessus le chien paresseux. Ça va très bien, merci ! Où est la gare ?
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München, schöne Straße.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación? ¡Mañana!
Il veloce volpe marrone salta sopra il cane pigro. Perché no? Città, caffè, più.
A rápida raposa marrom pula sobre o cão preguiçoso. Não, obrigado. Coração.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Спасибо.
Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Καλημέρα.
敏捷的棕色狐狸跳过了懒狗。你好，世界！今天天气很好。我们一起去吃饭吧。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界。ありがとうございます。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요, 감사합니다.
الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم.
तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है। नमस्ते दुनिया।
Emoji: 😀 😂 🙂 🎉 🚀 ❤️ 👍 🌍 🔥 ✨ 🐍 🤖 👩‍💻 🇫🇷
Math: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14, √2, ∀ x ∈ ℝ, → ← ↑ ↓, × ÷ ± ≠ ≈ °C €5 £3 ¥100.
Combining marks: e\u0301, n\u0303, a\u0308, cafe\u0301, naïve, résumé, Zoë, Åsa, Ångström.

The teacher asked the students to write a story about a journey. One wrote about a train that
crossed a whole continent in a week; another wrote about a small boat that sailed between islands;
a third wrote about walking to school on the first day, which was, she said, the longest journey
of all. The teacher read every story aloud, and the class voted for their favourite.

Good software is written for people first and computers second. Names should say what things are;
functions should do one thing; errors should say what went wrong and what to do about it. Tests
should check behaviour that matters, run quickly, and fail loudly when something breaks.
"""


class TokenizerFiles(NamedTuple):
    """The tokenizer part of a checkpoint directory, as file name -> JSON-ready content."""

    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    special_tokens_map: dict[str, Any]
    chat_template: str


def build_tokenizer(flavor: Flavor = "llama3") -> Tokenizer:
    """Train the built-in byte-level BPE (a few milliseconds) and add the special tokens last.

    ``qwen2`` is what real Qwen tokenizers do: NFC normalisation and one piece per digit. A qwen2
    checkpoint needs it because transformers loads any ``qwen2`` model's tokenizer with its own
    Qwen2Tokenizer class, which imposes that normaliser and split whatever tokenizer.json says.
    Text that is not in NFC then does not round-trip exactly (combining marks get composed).
    """
    tokenizer = Tokenizer(models.BPE())
    if flavor == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    pattern = _QWEN2_SPLIT if flavor == "qwen2" else _LLAMA3_SPLIT
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE - len(SPECIAL_TOKENS):  # corpus edited too far
        raise RuntimeError(
            f"built-in corpus too small: BPE learned {tokenizer.get_vocab_size()} tokens, "
            f"wanted {VOCAB_SIZE - len(SPECIAL_TOKENS)}"
        )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = special_token_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def tokenizer_files(model_max_length: int, flavor: Flavor = "llama3") -> TokenizerFiles:
    """Everything AutoTokenizer (and our light ``app.text.Tokenizer``) reads from a checkpoint."""
    tokenizer = build_tokenizer(flavor)
    tokenizer_json = tokenizer.to_str(pretty=True)  # vocab ordered by id, merges in learned order
    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # Byte-level BPE never needs one; explicit null stops Qwen2Tokenizer adding its default.
        "unk_token": None,
        # Cleaning up "spaces before punctuation" would break the exact round trip.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_tokens_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    return TokenizerFiles(tokenizer_json, tokenizer_config, special_tokens_map, CHAT_TEMPLATE)
