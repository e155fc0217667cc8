"""Multi-turn chat conversations for ``ninfer bench serve``: what each simulated user says.

Each client owns one conversation. Round ``r`` sends the whole history — the system prompt,
the user turns of rounds ≤ r and the assistant replies of rounds < r — as a chat user's client
does, so every round's prompt extends the previous round's prompt and reply (prefix reuse).

    round 0: [system, user0]
    round 1: [system, user0, reply0, user1]
    round 2: [system, user0, reply0, user1, reply1, user2]

The built-in mix crosses 8 topics with 8 places (64 distinct conversations behind one shared
system prompt); ``prompt_words`` replaces it with seeded random user turns of that many words
and no system prompt, for a controlled prompt length.
"""

from __future__ import annotations

import random

SYSTEM = ("You are a concise assistant for a travel and food help desk. Answer in two or three "
          "sentences, name concrete places, and say so when you are not sure.")

# (opening with {place}, follow-ups); round r > 0 takes follow-up (r - 1) mod their count.
TOPICS = [
    ("I am spending a long weekend in {place}. What should I see first?",
     ["Which of those is best on a rainy day?", "Where can I eat well near there?", "How do I get there by transit?"]),
    ("What is a traditional dish from {place} I could cook at home tonight?",
     ["What can I use instead of the hardest ingredient?", "How long does it take?", "What should I drink with it?"]),
    ("I am moving to {place} for work next month. Which neighbourhoods should I look at?",
     ["Which one is quietest?", "What does a one-bedroom flat cost there?", "How is the commute to the centre?"]),
    ("What should I pack for a week in {place} in late October?",
     ["And if it rains every day?", "Do I need a power adapter?", "Is tap water safe to drink?"]),
    ("Plan a cheap day out in {place} for two students.",
     ["Make it work without a car.", "Add one free museum.", "What if we only have the afternoon?"]),
    ("I have a six-hour layover in {place}. Is it worth leaving the airport?",
     ["How long is the trip into town?", "What is one thing I must not miss?", "Where can I leave my bag?"]),
    ("Which local market in {place} is worth visiting, and when?",
     ["What should I buy there?", "Is it fine to haggle?", "Where can I get coffee nearby?"]),
    ("Suggest a three-day itinerary for {place} with a child of seven.",
     ["Swap one day for something outdoors.", "Which places need tickets in advance?", "Where is a good playground?"]),
]
PLACES = ["Lisbon", "Kyoto", "Oaxaca", "Tbilisi", "Bergen", "Marrakesh", "Hanoi", "Valparaiso"]

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


class Conversation:
    """One client's chat: the messages so far; ``ask`` adds the next user turn, ``answer`` the reply."""

    def __init__(self, turns: list[str], system: str | None = None):
        self.turns = turns
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    def ask(self, r: int) -> list[dict]:
        """The messages of round ``r`` (a copy: the caller may serialise it while this one grows)."""
        self.messages.append({"role": "user", "content": self.turns[r]})
        return list(self.messages)

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def builtin_turns(client: int, rounds: int) -> list[str]:
    opening, follow = TOPICS[client % len(TOPICS)]
    place = PLACES[(client // len(TOPICS)) % len(PLACES)]
    return [opening.format(place=place)] + [follow[(r - 1) % len(follow)] for r in range(1, rounds)]


def random_turns(client: int, rounds: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed * 1_000_003 + client)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(rounds)]


def conversations(clients: int, rounds: int, prompt_words: int | None = None, seed: int = 0) -> list[Conversation]:
    if prompt_words:
        return [Conversation(random_turns(c, rounds, prompt_words, seed)) for c in range(clients)]
    return [Conversation(builtin_turns(c, rounds), SYSTEM) for c in range(clients)]
