"""Built-in training text for the tiny byte-level BPE tokenizer (see tiny_tokenizer.py).

Contract: `CORPUS` is a fixed string; changing it changes every tiny tokenizer (and so
every tiny model folder) built afterwards. It mixes English prose, code, numbers and
non-ASCII text (accents, CJK, Hangul, Cyrillic, Greek, emoji) so that the trained
vocabulary holds multi-byte tokens and a token stream can split a character.
"""

_PROSE = """\
The river ran slowly past the mill, carrying leaves and the occasional branch toward the sea.
Nobody in the village remembered when the wheel had last turned, but every child knew the story
of the miller who counted his sacks of flour twice each night and still lost one by morning.
In the spring the water rose, and the old stones hummed as if the machine were about to wake.

A serving system is judged by two numbers: how long the first token takes, and how steadily the
rest arrive. Prefill reads the whole prompt at once and is bound by compute; decode emits one
token per step and is bound by memory bandwidth. Splitting them across machines lets each side
use the batch size that suits it, at the price of moving the key-value cache over the network.

She opened the letter, read the first line, and folded it again. "Not today," she said quietly.
The clock on the wall ticked on; outside, a delivery van reversed with a patient beeping sound.
Later, when the rain stopped, they walked to the harbour and watched the ferries come and go,
counting the lights on each deck until the numbers stopped making sense.

Questions worth asking before any benchmark: What is the request rate? How long are the prompts?
Which percentile matters - p50, p90 or p99? Is the cache warm? Are we measuring tokens per second
per user, or per machine? A single number without its conditions is an anecdote, not a result.
"""

_CODE = '''\
def allocate(self, num_blocks: int) -> list[int] | None:
    """Take num_blocks free blocks, or return None when there is no room."""
    if num_blocks > len(self.free_block_ids):
        return None
    block_ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
    for block_id in block_ids:
        self.ref_counts[block_id] += 1
    return block_ids


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 16):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens

    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens


for i in range(10):
    print(f"step {i:02d}: loss={0.5 ** i:.4f}")

x = torch.zeros((2, 3), dtype=torch.float32)
y = x @ x.T + 1e-6
config = {"hidden_size": 256, "num_layers": 4, "rope_theta": 10000.0, "tie": True}
if __name__ == "__main__":
    main()

#include <stdio.h>
int main(void) {
    for (int i = 0; i < 8; ++i) { printf("%d\\n", i * i); }
    return 0;
}

SELECT user_id, COUNT(*) AS n FROM requests WHERE latency_ms > 250 GROUP BY user_id ORDER BY n DESC;
$ curl -s http://127.0.0.1:8000/v1/models | jq '.data[0].id'
'''

_NUMBERS = """\
0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192 65536
3.14159 2.71828 1.41421 0.5 0.25 0.125 -1 -42 +7 100% 99.9% 1e-5 6.02e23
2024-03-15 09:30:00 UTC, 12:45, 23:59:59; v1.2.3, #42, @user, a_b_c, x+y=z, [1, 2, 3], (a, b)
"""

_WORLD = """\
Français : Le café était déjà fermé, alors nous sommes allés à la crêperie près de l'église.
Où est la bibliothèque ? À gauche, après le théâtre. Ça coûte douze euros, voilà tout.
Español: El niño pequeño comió una manzana en el jardín; mañana irá a la montaña con su señora.
¿Dónde está la estación? ¡Qué día tan bonito! La canción del corazón sonó otra vez.
Deutsch: Die Straße war nass, und die Bäume rauschten über dem Fluss. Grüße aus München!
Übermorgen fährt der Zug um fünf Uhr; bitte nicht vergessen, die Tür zu schließen.
Português: A informação está disponível; não há razão para preocupação. Obrigado, até logo.
Ελληνικά: Η θάλασσα ήταν ήρεμη και ο ουρανός καθαρός. Καλημέρα σας!
Русский: Быстрая коричневая лиса прыгает через ленивую собаку. Спасибо, до свидания.
中文：今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据和计算资源。
服务器正在处理你的请求，请稍等。你好，世界！这是一个简单的测试句子。
日本語：東京は大きな都市です。今日はいい天気ですね。ありがとうございます。
ひらがなとカタカナ、そして漢字を混ぜて書きます。コンピューターが好きです。
한국어: 안녕하세요, 만나서 반갑습니다. 오늘 날씨가 정말 좋네요. 감사합니다.
Tiếng Việt: Xin chào, rất vui được gặp bạn. Hôm nay trời đẹp quá.
Emoji: 🙂 😀 🚀 🎉 ❤️ 👍 🔥 ✨ 🌍 🐍 🤖 📦 ✅ ❌ ⚠️ 👩‍💻 🇫🇷 🇯🇵 → ← ≤ ≥ ≠ ∞ ∑ √ π µs °C € £ ¥ © ™ …
Mixed: the café 🚀 served 中文 and naïve résumé fans; 東京 🎉 München; ok 👍 done ✅.
"""

CORPUS = "\n".join([_PROSE, _CODE, _NUMBERS, _WORLD, _PROSE.upper(), _WORLD, _CODE])
