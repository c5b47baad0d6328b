#!/bin/bash
cat > /app/textkit.py <<'PY'
"""Text helpers."""


def reverse_words(text):
    return " ".join(reversed(text.split()))


def count_vowels(text):
    return sum(c in "aeiouAEIOU" for c in text)


def is_palindrome(text):
    kept = [c.lower() for c in text if c.isalnum()]
    return kept == kept[::-1]


def title_case(text):
    return " ".join(w[:1].upper() + w[1:].lower() for w in text.split())
PY
