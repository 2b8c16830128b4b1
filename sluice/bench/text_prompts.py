"""Real-text prompt sets for `sluice bench spec` on a trained chat model.

`copy`: requests whose answers repeat much of their prompt (summarise or proofread a paragraph,
repeat code with a change), where prompt lookup (n-gram drafting) should pay. `chat`: open-ended
questions whose answers draw little from the prompt, where speculation must not cost.
Both are lists of single-turn conversations, made by cycling tasks over texts, so any number of
requests can be drawn; the texts were written for this benchmark.
"""

from __future__ import annotations

PARAGRAPHS = [
    "The river town grew up around a stone bridge built in the twelfth century. Merchants "
    "crossed it with wool and salt, and the tolls they paid built the market hall, the church "
    "tower and the first school. When the railway arrived in 1851 the bridge lost its trade, "
    "but the town kept its market, which still opens every Saturday morning.",
    "Honeybees find flowers by scent and colour, and they tell each other where to go with a "
    "dance. A bee that has found nectar walks a figure of eight on the comb; the angle of the "
    "straight run shows the direction of the food relative to the sun, and its length shows "
    "the distance. Other bees follow the dancer and then fly straight to the field.",
    "A good cup of tea starts with fresh water. Boil it once, let it cool for a minute for "
    "green tea, and pour it over the leaves in a warmed pot. Black tea needs three to five "
    "minutes, green tea two or three; longer steeping makes it bitter rather than stronger. "
    "Remove the leaves when the time is up so that the second cup tastes like the first.",
    "The library will close for renovation from the first of March until the end of June. "
    "During this time books can be returned at the town hall, and the reading room moves to "
    "the community centre on Elm Street, open from nine to five on weekdays. Online loans and "
    "the children's story hour continue as usual.",
    "Glaciers form where more snow falls in winter than melts in summer. Year after year the "
    "snow is pressed into firn and then into dense ice, which begins to flow downhill under "
    "its own weight. As it moves it grinds the rock beneath it, carving deep valleys and "
    "carrying stones far from where they came from.",
    "Our team meets every Monday at ten to plan the week. Each person says what they finished, "
    "what they will do next and what is blocking them. Decisions are written in the shared "
    "notes, and anyone who misses the meeting reads them before lunch. Meetings end after "
    "thirty minutes, even when items are left, which then move to Thursday.",
]

CODE = [
    "def total_price(items):\n    x = 0\n    for item in items:\n        x = x + item.price * "
    "item.quantity\n    return x\n",
    "def count_words(text):\n    x = {}\n    for word in text.split():\n        word = "
    "word.lower()\n        x[word] = x.get(word, 0) + 1\n    return x\n",
    "def average(values):\n    x = 0\n    for value in values:\n        x += value\n    if not "
    "values:\n        return 0\n    return x / len(values)\n",
]

_TEXT_TASKS = [
    "Summarise the following paragraph in two sentences.\n\n{text}",
    "Correct any mistakes and return the paragraph unchanged otherwise.\n\n{text}",
    "Repeat the following paragraph word for word.\n\n{text}",
    "Rewrite the following paragraph in the past tense.\n\n{text}",
]
_CODE_TASKS = [
    "Repeat this Python function, renaming the variable x to result.\n\n{text}",
    "Add a docstring to this Python function and return the whole function.\n\n{text}",
]

QUESTIONS = [
    "Tell me about the history of the bicycle.",
    "What are some good habits for learning a new language?",
    "Write a short story about a lighthouse keeper.",
    "Why is the sky blue?",
    "Give me ideas for a birthday party for a ten-year-old.",
    "What should I pack for a weekend hiking trip?",
    "Explain how vaccines work.",
    "Write a poem about autumn leaves.",
    "What are the benefits of regular exercise?",
    "How do I make a simple tomato soup?",
    "Describe a day in the life of a medieval farmer.",
    "What is the difference between weather and climate?",
    "Suggest three books for someone who likes mysteries.",
    "How can I improve my sleep?",
    "Explain what a computer program is to a child.",
    "Write a letter thanking a teacher.",
]


def copy_conversations() -> list[list[dict[str, str]]]:
    items = [task.format(text=text) for text in PARAGRAPHS for task in _TEXT_TASKS]
    items += [task.format(text=code) for code in CODE for task in _CODE_TASKS]
    return [[{"role": "user", "content": item}] for item in items]


def chat_conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": question}] for question in QUESTIONS]


def conversations(workload: str, num: int) -> list[list[dict[str, str]]]:
    """`num` conversations of the workload ("copy" or "chat"), cycling its set."""
    pool = copy_conversations() if workload == "copy" else chat_conversations()
    return [pool[i % len(pool)] for i in range(num)]
