"""Text helpers."""


def reverse_words(text):
    raise NotImplementedError


def count_vowels(text):
    raise NotImplementedError


def is_palindrome(text):
    raise NotImplementedError


def title_case(text):
    raise NotImplementedError
