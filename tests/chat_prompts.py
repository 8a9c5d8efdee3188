"""Sixteen chats for tests of the real instruct model (SmolLM2-135M-Instruct): questions
with checkable answers, instructions, a system prompt, a multi-turn exchange, unicode and
code; rendered with the model's chat template by each test."""
from __future__ import annotations

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Explain what a CPU does, briefly."}],
    [{"role": "user", "content": "What is the chemical symbol for gold?"}],
    [{"role": "user", "content": "Name the three primary colors."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "How many days are there in a week?"}],
    [{"role": "user", "content": "Which gas do plants absorb from the air for photosynthesis?"}],
    [{"role": "user", "content": "Give me a short tip for learning a new language."}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
    [{"role": "system", "content": "You answer like a pirate."},
     {"role": "user", "content": "What is the weather like at sea?"}],
    [{"role": "user", "content": "Summarize in one sentence: the cat sat on the mat all afternoon."}],
    [{"role": "user", "content": "Qu'est-ce que la photosynthèse ? Réponds brièvement. 🌱"}],
    [{"role": "user", "content": "Continue the sequence: 1, 2, 4, 8,"}],
]
