"""Built-in training corpus for the tiny test model's tokenizer.

The tiny model exists so that tests and the demo run offline, so its tokenizer is
trained from the text below rather than from anything downloaded. The text is
original and deliberately varied (prose, chat turns, Python, JSON tool calls,
numbers, punctuation and some non-ASCII) so that the learned merges cover the
kinds of strings the serving runtime will see. Everything is a constant: the
corpus, and hence the trained tokenizer, is the same on every machine.
"""

from __future__ import annotations

PROSE = """\
The harbour town of Lenmouth wakes before the sun. Fishing boats slip out past the
breakwater while the bakery on Quay Street lights its ovens, and by six o'clock the
smell of bread has reached the lighthouse. Most visitors arrive in summer, but the
people who live there say the town is at its best in October, when the tourists have
gone home and the sea turns the colour of slate.

A river begins as rain. Water falls on the hills, soaks into the soil, and gathers in
small channels that join one another on the way down. Each stream carries a little
sand and a few stones. Over thousands of years the river cuts a valley, drops its
load where it slows, and builds a wide, flat plain near the coast. Farmers have
always liked such plains, because the soil is deep and easy to work.

Good bread needs only four things: flour, water, salt and time. Mix the flour and
water first and let them rest for half an hour; the dough becomes smoother without
any effort from you. Add the salt and the yeast, fold the dough every thirty minutes
for two hours, then shape it and leave it in a cool place overnight. Bake it in a
very hot oven, with steam for the first fifteen minutes, until the crust is dark.

The library had been closed for repairs since the spring. When it finally opened
again, the reading room had new lamps, the shelves had been rebuilt in oak, and the
old card catalogue had been moved into a glass case near the door, where children
pressed their noses against it and asked what it was for.

Computers store numbers in binary, using only the digits zero and one. A group of
eight binary digits is called a byte, and a byte can hold any whole number from 0 to
255. Text is stored by giving every character a number; the most common scheme today
is Unicode, usually written to disk in the UTF-8 encoding, which uses one byte for
plain English letters and up to four bytes for other characters.

Maya had never driven a tractor, but the field needed ploughing and her uncle's back
was bad again. She read the manual twice, checked the oil, and climbed into the seat.
The engine coughed, caught, and settled into a low, steady rumble. By noon she had
finished half the field; by evening the rows were straight enough that her uncle
pretended not to be impressed.

A language model predicts the next token in a sequence. Given the words "The cat sat
on the", a well-trained model will give a high probability to "mat" and a low one to
"theorem". During generation the model produces one token at a time: it samples a
token from the predicted distribution, appends it to the input, and repeats. Serving
many users at once means batching these steps together so the hardware stays busy.

The museum's newest exhibit is a clock that runs for a hundred years on a single
winding. Its pendulum swings once every four seconds, and a tiny gear turns once a
century. The engineers who built it said the hardest part was not the mechanism but
choosing materials that would not rust, warp or crack in that time.

On clear nights in the mountains you can see the Milky Way without a telescope. It
looks like a pale cloud stretched across the sky, but it is made of billions of
stars, so distant that their light blends together. Our own sun is one of them,
about two thirds of the way out from the centre of the galaxy.

Spring came late that year. The snow stayed on the north side of the hedges until
April, and the swallows, when they came, seemed surprised by the cold. Still, the
apple trees flowered on time, and by May the orchard was loud with bees.

Every cache has the same problem: it is smaller than the thing it is caching. When a
new item arrives and the cache is full, something must be thrown away. A simple
policy evicts the item that was used least recently; a better one also considers how
expensive each item would be to rebuild. Prefix caches for language models keep the
key and value tensors of earlier tokens so that a repeated prompt does not have to be
processed twice.

The old railway line has become a walking path. It runs for eleven miles between the
two villages, level the whole way, through cuttings full of ferns and over a viaduct
with a view of the reservoir. Cyclists use it on weekends, and on weekday mornings
you mostly meet dog walkers and the occasional heron.

Tea was first drunk in China, then spread along trade routes to Japan, India, Persia
and eventually Europe. In Britain it became so popular in the eighteenth century that
it was heavily taxed, and smuggling tea was a common and profitable crime. Today the
largest producers are China, India, Kenya and Sri Lanka.

The committee met on Tuesday to discuss the budget. After two hours they agreed to
repair the roof of the community hall, postpone the new playground until next year,
and ask the council for help with the cost of the footbridge. The minutes will be
published on the notice board by Friday.

If you want to learn a musical instrument as an adult, practise a little every day
rather than a lot once a week. Twenty minutes is enough. Start each session with
something you can already play well, spend most of the time on one small difficult
passage, and finish with something you enjoy. Progress feels slow, but it is steady.

Volcanoes form where molten rock rises through the crust. Some, like those in Hawaii,
erupt gently, with rivers of lava that flow for miles. Others explode violently,
because their magma is thick and full of gas. The ash from a large eruption can
circle the whole planet and cool the climate for a year or two.

The inspector looked at the broken window, then at the muddy footprints on the
carpet, then at the butler. "Tell me," she said, "who else has a key to the garden
door?" The butler hesitated for just a moment too long. "Only the gardener, madam,"
he said, "and he has been away since Sunday."
"""

DIALOGUE = """\
User: Hi! Can you help me plan a trip to Lisbon?
Assistant: Of course. How many days will you be there, and what do you enjoy most:
food, museums, walking, or the beach?
User: Four days. Mostly food and walking, maybe one day trip.
Assistant: Here is a simple plan. Day 1: explore Alfama and the castle, then dinner in
Bairro Alto. Day 2: walk along the river to Belém and try the custard tarts. Day 3:
take the train to Sintra for the palaces and gardens. Day 4: visit the market at Cais
do Sodré and spend the afternoon in the Príncipe Real neighbourhood.

User: What's the capital of Australia?
Assistant: The capital of Australia is Canberra, not Sydney as many people assume.

User: Please summarise this in one sentence: "The meeting was moved from Monday to
Wednesday because the projector in room 4 is broken and the replacement will not
arrive until Tuesday afternoon."
Assistant: The meeting moved to Wednesday because room 4's projector is broken until
a replacement arrives on Tuesday.

User: Write a haiku about autumn.
Assistant: Red leaves on the path,
the wind counts them one by one,
then throws them all up.

User: How do I reverse a list in Python?
Assistant: Use slicing to make a reversed copy, `items[::-1]`, or call
`items.reverse()` to reverse the list in place. The built-in `reversed(items)`
returns an iterator if you only need to loop over it backwards.

User: I feel nervous about my exam tomorrow.
Assistant: That's very normal, and a little nervousness can even help you focus.
Tonight, review your notes briefly, then stop and do something relaxing. Get a full
night's sleep, eat breakfast, and arrive early. You have prepared for this.

User: What's the weather like in Paris today?
Assistant: Let me check that for you.
Tool: {"city": "Paris", "temperature_c": 18, "condition": "partly cloudy"}
Assistant: It's 18 °C and partly cloudy in Paris right now.

User: Convert 5 miles to kilometres.
Assistant: 5 miles is about 8.05 kilometres (1 mile ≈ 1.609 km).

User: Can you explain recursion simply?
Assistant: A recursive function solves a problem by calling itself on a smaller
version of the same problem, until it reaches a case so small that the answer is
obvious. For example, the factorial of 5 is 5 times the factorial of 4, and the
factorial of 1 is just 1.

User: Translate "good morning" into French, Spanish and German.
Assistant: French: « Bonjour ». Spanish: «Buenos días». German: „Guten Morgen".

User: thanks!!
Assistant: You're welcome! Let me know if there's anything else I can do.

System: You are a concise assistant. Answer in at most two sentences.
User: Why is the sky blue?
Assistant: Sunlight is scattered by molecules in the air, and blue light is scattered
much more than red because its wavelength is shorter. So blue light reaches our eyes
from every direction in the sky.

User: Is 97 a prime number?
Assistant: Yes. 97 is not divisible by 2, 3, 5 or 7, and since 10 × 10 = 100 is larger
than 97, no other factor needs checking.

User: Book a table for two at 7pm.
Assistant: I'll look for a restaurant with availability at 19:00 for 2 people.
Tool: {"status": "confirmed", "restaurant": "The Green Fig", "time": "19:00", "party_size": 2}
Assistant: Done! Your table for two at The Green Fig is confirmed for 7 pm.

User: what is 12% of 250?
Assistant: 12% of 250 is 30.

User: Give me three names for a grey cat.
Assistant: Pebble, Smoke, and Earl Grey.

User: Tell me a fun fact.
Assistant: Octopuses have three hearts and blue blood.

User: Can you set a reminder for my dentist appointment on 14 March at 09:30?
Assistant: Sure, I've set a reminder for your dentist appointment on 14 March at 09:30.

User: Who wrote "Pride and Prejudice"?
Assistant: Jane Austen wrote it; it was published in 1813.
"""

CODE = '''\
def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class LRUCache:
    """A small least-recently-used cache built on an ordered dict."""

    def __init__(self, capacity: int) -> None:
        from collections import OrderedDict

        self.capacity = capacity
        self._data = OrderedDict()

    def get(self, key, default=None):
        if key not in self._data:
            return default
        self._data.move_to_end(key)
        return self._data[key]

    def put(self, key, value) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)


import json
import os
from pathlib import Path


def load_config(path: str | os.PathLike) -> dict:
    """Read a JSON config file, returning an empty dict if it is missing."""
    p = Path(path)
    if not p.exists():
        return {}
    with p.open("r", encoding="utf-8") as f:
        return json.load(f)


async def fetch_all(client, urls):
    results = {}
    for url in urls:
        response = await client.get(url, timeout=10.0)
        response.raise_for_status()
        results[url] = response.json()
    return results


def softmax(logits):
    m = max(logits)
    exps = [math.exp(x - m) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def top_k(probs, k=5):
    order = sorted(range(len(probs)), key=lambda i: probs[i], reverse=True)
    return order[:k]


for i in range(1, 16):
    if i % 15 == 0:
        print("FizzBuzz")
    elif i % 3 == 0:
        print("Fizz")
    elif i % 5 == 0:
        print("Buzz")
    else:
        print(i)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    stop: list[str] = field(default_factory=list)

    def is_greedy(self) -> bool:
        return self.temperature == 0.0


try:
    value = int(text)
except ValueError as exc:
    raise ValueError(f"expected an integer, got {text!r}") from exc
finally:
    cleanup()

x = [n * n for n in range(10) if n % 2 == 1]
y = {k: v for k, v in zip("abc", [1, 2, 3])}
assert sum(x) == 165 and y["b"] == 2
print(f"{len(x)=} {y!r}")
'''

JSON_SNIPPETS = """\
{"name": "get_weather", "arguments": {"city": "Paris"}}
{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}
{"name": "get_weather", "arguments": {"city": "New York", "unit": "fahrenheit"}}
{"name": "search_web", "arguments": {"query": "best hiking trails near Oslo", "max_results": 5}}
{"name": "send_email", "arguments": {"to": "alex@example.com", "subject": "Lunch", "body": "Are you free at noon?"}}
{"name": "calculate", "arguments": {"expression": "(17 + 25) * 3 / 7"}}
{"name": "get_stock_price", "arguments": {"symbol": "ACME", "currency": "EUR"}}
{"name": "create_event", "arguments": {"title": "Team sync", "start": "2024-05-06T10:00:00Z", "duration_minutes": 30}}
{"name": "translate", "arguments": {"text": "Where is the station?", "target_language": "de"}}
{"name": "lookup_order", "arguments": {"order_id": 48213}}
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name, e.g. Paris"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"type": "function", "function": {"name": "search_web", "description": "Search the web and return the top results.", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}, "required": ["query"]}}}
{"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}
{"id": "call_1", "type": "function", "function": {"name": "lookup_order", "arguments": "{\\"order_id\\": 48213}"}}
{"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "partly cloudy", "humidity": 0.62}
{"city": "Tokyo", "temperature": 24, "unit": "celsius", "condition": "sunny", "humidity": 0.48}
{"results": [{"title": "Trail guide", "url": "https://example.org/trails"}, {"title": "Maps", "url": "https://example.org/maps"}]}
{"order_id": 48213, "status": "shipped", "items": [{"sku": "A-101", "qty": 2}, {"sku": "B-7", "qty": 1}], "total": 59.90}
{"role": "user", "content": "What's the weather in Paris?"}
{"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
{"role": "tool", "tool_call_id": "call_0", "content": "{\\"temperature\\": 18}"}
{"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}], "max_tokens": 64, "temperature": 0.7, "top_p": 0.95, "stream": true}
{"id": "cmpl-001", "object": "chat.completion", "created": 1700000000, "choices": [{"index": 0, "finish_reason": "stop"}], "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}}
{"error": {"message": "Invalid request: max_tokens must be positive", "type": "invalid_request_error", "code": 400}}
[1, 2, 3, 5, 8, 13, 21, 34]
{"ok": true, "count": 0, "items": [], "next": null}
"""

NUMBERS = """\
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 64 99 100 128 255 256
512 1000 1024 2048 4096 8192 10000 65536 100000 1000000 3.14159 2.71828 1.41421 0.5
-1 -42 +7 1e-5 6.02e23 1/3 3/4 99.9% 50% 0.001 12:30 23:59 07:05
2024-01-15 1999-12-31 2038-01-19 03/04/2025 14 March 2023 1st 2nd 3rd 4th 21st
2 + 2 = 4; 7 * 8 = 56; 144 / 12 = 12; 2 ** 10 = 1024; 17 % 5 = 2; 9 - 13 = -4
Order #48213 costs $59.90 (€54.80, £47.10, ¥8,900). Tax: 20%. Total: $71.88.
Phone: +44 20 7946 0958. Room 4B, floor 12. Flight BA 117 departs at 18:45 from gate 23.
The population grew from 12,500 in 1950 to 48,300 in 2020, an increase of 286.4%.
Temperatures ranged from -3 °C to 31 °C; the average was 14.2 °C.
x = 3, y = -2, z = x * y + 10 = 4. The answer is 42. Version 1.2.3 was released in v2.
Batch sizes: 1, 2, 4, 8, 16, 32, 64, 128, 256. Block size 16; 4,096 blocks; 65,536 tokens.
"""

PUNCTUATION = """\
Wait... what? No way! Really?! Yes -- really. (Well, mostly.) [See note 3.]
"Quotes", 'single quotes', `backticks`, <angle brackets>, {braces}, |pipes|.
Semicolons; colons: commas, full stops. Dashes - and en dashes – and em dashes — all differ.
Email: someone@example.com. URL: https://example.com/path?query=1&page=2#top.
Path: /usr/local/bin/python3 and C:\\Users\\maya\\notes.txt. Hashtag: #tinyModel.
Math: a < b, b > c, a <= c, x != y, x == y, x >= 0, ~x, x & y, x | y, x ^ y.
Markdown: **bold**, _italic_, # Heading, - list item, 1. numbered item, > quote.
TODO: fix the bug!!! FIXME?? NOTE: done. *** --- ___ ... !!! ??? ;;; ::
It's, don't, won't, they're, we've, I'm, you'll, she'd, O'Neill, rock 'n' roll.
"""

MULTILINGUAL = """\
Café, naïve, façade, résumé, crème brûlée, jalapeño, piñata, Zürich, Köln, Ærø, smørrebrød.
Français : « Le café est prêt, voulez-vous du pain et du fromage ? » — « Oui, merci ! »
Español: ¿Dónde está la estación? ¡Qué día tan bonito! El niño comió una manzana.
Deutsch: Die Straße ist nass, weil es geregnet hat. Schöne Grüße aus München!
Português: Não sei se ele já chegou; a reunião começa às três horas.
Italiano: Però è già tardi, e la città è piena di turisti.
Polski: Zażółć gęślą jaźń. Čeština: Příliš žluťoučký kůň. Türkçe: Günaydın, nasılsın?
Ελληνικά: Καλημέρα κόσμε. Русский: Привет, мир! Как дела?
日本語: こんにちは、世界。東京は晴れです。
中文: 你好，世界！今天天气很好。我们去公园吧。
한국어: 안녕하세요. 감사합니다.
Emoji: 😀 🎉 👍 ❤️ 🚀 🌍 ☕ 🐍 ✅ ❌ ⭐
Symbols: © ® ™ ° ± × ÷ ≈ ≠ ≤ ≥ ∞ → ← ↑ ↓ • … ‰ § ¶ µ π Ω √ ∑
The café in Zürich served crème brûlée and espresso; the bill was 12,50 € 😀.
She said “hello” and ‘goodbye’ — then left… 👋
"""

STORIES = """\
Once upon a time, in a village at the edge of a great forest, there lived a clockmaker
named Tobias. His clocks were famous across the valley, not because they were
beautiful, though they were, but because they were never wrong. People said that if
Tobias's clock and the church bell disagreed, it was the bell that needed repairing.

One winter a stranger came to the shop with a broken watch. It was small and silver,
with no maker's mark, and when Tobias opened the case he found that the gears inside
were made of something he had never seen: not brass, not steel, but a pale metal that
was warm to the touch. "Can you fix it?" the stranger asked. Tobias turned it over in
his hands for a long time. "I can try," he said, "but I cannot promise."

He worked on the watch every evening for a month. He cleaned each gear, straightened
each spring, and made a new balance wheel from the finest steel he had. On the last
night of the month the watch began to tick. It ticked slowly at first, then faster,
and then, to his astonishment, the hands began to turn backwards.

The stranger returned the next morning. She did not seem surprised. "It keeps the time
that is left," she explained, "not the time that has passed." She paid him in silver
coins, thanked him, and walked out into the snow. Tobias never saw her again, but he
kept one of the coins on his workbench for the rest of his life.

Years later, when his granddaughter asked him why he never hurried, Tobias would point
at the coin and smile. "Everyone has a watch like hers," he would say. "Most people
simply never open the case."

The robot's name was Unit Seven, but the children called it Sev. It had been built to
carry crates in a warehouse, and it was not very good at anything else. When the
warehouse closed, Sev was sold to a school, where it carried books, chairs and, once,
an enormous cake for the headteacher's retirement party. Sev liked the school. The
corridors were noisy, the floors were sticky, and nobody ever asked it to move faster.

A small boat drifted into the bay at dawn, with nobody aboard. Its sail was folded
neatly, its oars were tied down, and on the bench lay a notebook wrapped in oilcloth.
The harbour master opened it carefully. Every page was filled with drawings of birds:
gulls, terns, cormorants, puffins, each one labelled with a date and a place. The last
page showed a bird none of them recognised, and underneath it someone had written,
in small neat letters, "Found it at last."
"""

FACTS = """\
Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees.
The Earth orbits the Sun once every 365.25 days, which is why we have leap years.
Light travels about 300,000 kilometres per second in a vacuum.
The human heart beats around 100,000 times a day.
Honey never spoils; archaeologists have found edible honey in ancient tombs.
The Pacific is the largest and deepest ocean on Earth.
Mount Everest is 8,849 metres high, the tallest mountain above sea level.
An adult human body has 206 bones, while a newborn baby has closer to 300.
The chemical symbol for gold is Au, from the Latin word aurum.
A day on Venus is longer than a year on Venus.
Bananas are berries, but strawberries are not.
The first programmable electronic computers were built in the 1940s.
Python was first released in 1991; its name comes from a comedy group, not the snake.
The speed of sound in air is roughly 343 metres per second at room temperature.
Sharks existed before trees: the oldest shark fossils are about 450 million years old.
The Great Wall of China is not visible to the naked eye from the Moon.
Lightning is about five times hotter than the surface of the Sun.
Octopuses can change both the colour and the texture of their skin.
Most of the oxygen we breathe is produced by tiny plants in the ocean.
A group of crows is called a murder, and a group of owls is called a parliament.
"""

INSTRUCTIONS = """\
How to make a cup of tea: boil fresh water, warm the pot, add one teaspoon of leaves
per cup, pour the water over the leaves, wait three to five minutes, then strain.

How to change a bicycle tyre:
1. Release the brake and remove the wheel.
2. Use tyre levers to lift one side of the tyre off the rim.
3. Pull out the old inner tube and check the tyre for sharp objects.
4. Inflate the new tube slightly, push it into the tyre, and refit the tyre.
5. Pump the tyre to the pressure printed on its side and refit the wheel.

Steps to debug a failing test:
- Read the error message carefully; it usually says exactly what went wrong.
- Reproduce the failure with the smallest possible input.
- Check your assumptions by printing or logging intermediate values.
- Change one thing at a time, and rerun the test after every change.
- When it passes, add a regression test so the bug cannot return unnoticed.

Packing list for a weekend hike: water bottle, map, compass, waterproof jacket, warm
hat, sandwiches, chocolate, first-aid kit, torch, spare socks and a fully charged phone.

Safety notice: Do not open the cover while the machine is running. Disconnect the
power supply before cleaning. Keep children and pets away from moving parts. In case
of emergency, press the red button on the left-hand side of the panel.

Recipe: Lemon pancakes (serves 4)
Ingredients: 200 g flour, 2 eggs, 300 ml milk, 1 lemon, a pinch of salt, butter.
Method: Whisk the flour, eggs, milk and salt into a smooth batter. Grate in the lemon
zest and rest the batter for 20 minutes. Melt a little butter in a hot pan, pour in a
thin layer of batter, and cook for one minute on each side. Serve with lemon juice
and sugar.
"""

CHAT_TURNS = """\
user: hello
assistant: Hello! How can I help you today?
user: what can you do?
assistant: I can answer questions, summarise text, write short stories or poems,
explain code, and call tools such as a weather service or a calculator when they are
available.
user: call the calculator with 17 * 23
assistant: {"name": "calculate", "arguments": {"expression": "17 * 23"}}
tool: {"result": 391}
assistant: 17 × 23 = 391.
user: and what's the weather in Berlin and Madrid?
assistant: {"name": "get_weather", "arguments": {"city": "Berlin"}}
assistant: {"name": "get_weather", "arguments": {"city": "Madrid"}}
tool: {"city": "Berlin", "temperature": 9, "condition": "rain"}
tool: {"city": "Madrid", "temperature": 21, "condition": "sunny"}
assistant: Berlin is 9 °C with rain, and Madrid is 21 °C and sunny.
user: ok, thank you. bye
assistant: Goodbye, and have a lovely day!
developer: Always answer in English, even if the user writes in another language.
user: ¿Qué hora es en Tokio?
assistant: I don't have access to the current time, but Tokyo is 9 hours ahead of UTC.
user: I'm thinking about learning to code. Where should I start?
assistant: Pick one language, such as Python, and one small project you care about,
like a program that tracks your expenses. Work through a beginner tutorial, then build
your project step by step, looking things up as you go.
user: can you think step by step: if a train leaves at 14:10 and the trip takes 2 h 35 min, when does it arrive?
assistant: 14:10 plus 2 hours is 16:10, and plus 35 minutes is 16:45. It arrives at 16:45.
"""

ESSAYS = """\
Why queues form. Imagine a single checkout in a small shop. Customers arrive at random,
on average one every two minutes, and each takes on average a minute and a half to
serve. The cashier is busy three quarters of the time, which sounds comfortable, yet
queues still form, because arrivals bunch together. As the cashier gets busier the
average wait grows very quickly: at ninety percent utilisation it is several times
longer than at seventy-five. This is why systems that must respond quickly, from
hospital wards to web servers, are deliberately run with spare capacity.

On keeping notes. A note that cannot be found is the same as no note at all. The most
useful habit is not a clever app or a complicated system but a single place where
everything goes first, reviewed once a week. During the review, throw away what no
longer matters, move tasks to a calendar, and file reference material under one plain,
obvious name. Simple systems survive busy months; elaborate ones are abandoned.

The economics of the lighthouse. For a long time economists used the lighthouse as the
perfect example of a public good: every passing ship benefits from its light, and
nobody can be stopped from seeing it, so no private company would build one. Then a
historian pointed out that many early English lighthouses were in fact built and run
privately, paid for by fees collected from ships when they entered nearby ports. The
example survived, but with a footnote.

Memory and sleep. Researchers have found that sleep helps to fix new memories. In one
kind of experiment, volunteers learn a list of word pairs in the evening and are
tested the next morning; those who slept remember more than those who stayed awake
for the same number of hours. Brief naps during the day appear to help too, especially
when they include a period of deep sleep.

The case for boring technology. Every new tool a team adopts brings unknown failure
modes, missing documentation and a small tax on everyone's attention. Mature tools
have their problems too, but those problems are known, searchable and usually
written down. A sensible rule is to allow yourself only a few new technologies at a
time, and to spend them where they give a real advantage rather than where they are
merely fashionable.

Gardening in small spaces. A balcony two metres long can grow a surprising amount of
food. Tomatoes, beans and courgettes do well in large pots, herbs thrive in window
boxes, and strawberries can hang from a basket. The main difficulties are water and
wind: pots dry out fast in summer, and tall plants need to be tied to something
sturdy. A layer of mulch on top of the soil helps with both.

How streaming works. When a server streams a response, it sends the text in small
pieces as soon as each piece is ready, instead of waiting for the whole answer. The
client shows each piece as it arrives, so the user sees the first words after a
fraction of a second. Under the hood this is often a long-lived HTTP response using
server-sent events, where every chunk is a line beginning with "data:" followed by a
JSON object, and the stream ends with a final "data: [DONE]" line.

Attention, briefly. In a transformer, each token produces a query, a key and a value.
The query of the current token is compared with the keys of all earlier tokens; the
resulting scores are normalised with a softmax and used to average the values. The
keys and values of earlier tokens never change, so a server can store them in a cache
and reuse them for every later step, which turns an expensive quadratic computation
into a cheap incremental one. Linear attention variants go further and compress the
whole history into a fixed-size state that is updated once per token.
"""

MORE_DIALOGUE = """\
User: My code prints None instead of the sum. What's wrong?
    def add(a, b):
        total = a + b
    print(add(2, 3))
Assistant: The function computes `total` but never returns it, so Python returns
None by default. Add `return total` at the end of the function.

User: Can you recommend a book for a long flight?
Assistant: If you like adventure, try a classic sea story; if you prefer something
lighter, a collection of short stories is ideal, because you can stop at any point.

User: Please give me the JSON for a user named Ana, age 31, who likes chess and tea.
Assistant: {"name": "Ana", "age": 31, "likes": ["chess", "tea"]}

User: How long should I boil an egg?
Assistant: About 6 minutes for a soft, runny yolk, 8 minutes for a jammy one, and
10 to 11 minutes for hard-boiled. Start timing once the water is boiling again.

User: Rewrite this more politely: "Send me the report now."
Assistant: "Could you please send me the report when you have a moment? Thank you!"

User: What is the difference between a list and a tuple?
Assistant: Both are ordered sequences, but a list is mutable, so you can add, remove
or change items, while a tuple is immutable once created. Tuples can therefore be
used as dictionary keys, and they signal that the data is not meant to change.

User: Count the letters in "strawberry".
Assistant: "strawberry" has 10 letters: s-t-r-a-w-b-e-r-r-y, including three r's.

User: Is it going to rain in London tomorrow?
Assistant: I'll check the forecast.
Tool: {"city": "London", "date": "tomorrow", "chance_of_rain": 0.8, "high_c": 13, "low_c": 8}
Assistant: Probably, yes: there's an 80% chance of rain, with a high of 13 °C.

User: Solve 3x + 5 = 20.
Assistant: Subtract 5 from both sides to get 3x = 15, then divide by 3: x = 5.

User: Suggest a name for my bakery.
Assistant: How about "Rise & Shine", "The Daily Crumb" or "Flour Power"?

User: Who are you?
Assistant: I'm a small test assistant. I'm mostly here to check that the serving
system works, so my answers may be short and sometimes silly.
"""

MORE_CODE = '''\
import asyncio
from typing import AsyncIterator


async def stream_tokens(engine, request) -> AsyncIterator[str]:
    """Yield decoded text pieces as the engine produces tokens."""
    async for output in engine.generate(request):
        if output.finished:
            break
        yield output.text


def chunked(seq, size):
    """Split seq into lists of at most size items."""
    return [seq[i : i + size] for i in range(0, len(seq), size)]


def parse_tool_call(text: str) -> dict | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or "name" not in obj:
        return None
    obj.setdefault("arguments", {})
    return obj


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self) -> int:
        if not self.free:
            raise MemoryError("out of KV cache blocks")
        block = self.free.pop()
        self.ref_counts[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free.append(block)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    args = parser.parse_args()
    main(args)
'''

LETTERS = """\
Dear Mrs Okafor,

Thank you for your letter of 3 June and for the photographs of the garden wall. I am
sorry to hear that the repair has already started to crack. I have asked our builder,
Mr Hale, to visit on Thursday morning between 9 and 11 to inspect the damage. If the
problem is caused by our work, we will of course fix it at no charge.

Kind regards,
Daniel Price
Price & Sons Building Ltd.

Hi Sam,

Just a quick note to say the tickets arrived! We're in row F, seats 12 and 13, and the
show starts at half past seven, so let's meet outside the theatre at seven. I'll bring
snacks. Don't forget your umbrella; the forecast says rain all evening.

See you soon,
Priya

To whom it may concern,

I am writing to recommend Elena Marsh for the position of assistant librarian. Elena
worked with us for three years as a volunteer and then as a part-time clerk. She is
patient with visitors, careful with records, and quick to learn new systems; last
year she reorganised our entire local history collection without being asked.

Yours faithfully,
R. Adeyemi, Head Librarian
"""

NOTES = """\
Release notes, version 0.4.0
- Added streaming responses for the chat endpoint.
- Requests can now set a stop list of up to four strings.
- Fixed a crash when a prompt was exactly one block long.
- The scheduler now preempts the newest request first when memory runs out.
- Improved throughput by about 12% on long prompts by batching prefill chunks.
- Deprecated the `max_length` option; use `max_tokens` instead.

Meeting notes (Thursday)
Attendees: Ana, Ben, Chen, Dara.
1. Latency dashboard: p50 is fine, p99 spikes during deploys. Ben to investigate.
2. Cache hit rate dropped from 71% to 58% after the tokenizer change. Chen suspects
   that the system prompt now tokenizes differently; will compare token ids.
3. Next release planned for the 21st. Dara owns the changelog.
Action items: Ben - deploy spikes; Chen - token id diff; Dara - changelog.

Glossary
prefill: processing the prompt tokens before the first output token is produced.
decode: generating output tokens one at a time after the prefill.
batch: a group of requests processed together in one forward pass.
preemption: pausing a running request to free memory for others, resuming it later.
prefix cache: stored state for the start of a prompt, reused when another request
begins with exactly the same tokens.
tokenizer: the component that turns text into integer ids and back again.
"""

POEMS = """\
The kettle hums a quiet tune,
the window holds a paper moon,
and somewhere down the sleeping street
a fox goes by on silent feet.

Small boats, small boats, where do you go?
Out past the rocks where the cold winds blow,
out past the buoys and the gulls' loud cries,
home again under the evening skies.

I counted stars until they blurred,
I lost the thread of every word,
and still the night went on and on,
and still the sky was there at dawn.
"""

CORPUS: list[str] = [
    PROSE,
    DIALOGUE,
    CODE,
    JSON_SNIPPETS,
    NUMBERS,
    PUNCTUATION,
    MULTILINGUAL,
    STORIES,
    FACTS,
    INSTRUCTIONS,
    CHAT_TURNS,
    ESSAYS,
    MORE_DIALOGUE,
    MORE_CODE,
    LETTERS,
    NOTES,
    POEMS,
]
