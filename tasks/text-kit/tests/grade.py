import json
import sys

sys.path.insert(0, "/app")

CHECKS = {
    "reverse_words": [(("hello big  world",), "world big hello"), (("one",), "one")],
    "count_vowels": [(("Education",), 5), (("rhythm",), 0)],
    "is_palindrome": [(("A man, a plan, a canal: Panama",), True), (("kiln",), False)],
    "title_case": [(("hello   wORLD",), "Hello World"), (("a",), "A")],
}


def passes(name):
    try:
        import textkit
        function = getattr(textkit, name)
        return all(function(*args) == expected for args, expected in CHECKS[name])
    except Exception:
        return False


passed = sum(passes(name) for name in CHECKS)
print(json.dumps({"reward": passed / len(CHECKS), "passed": passed, "total": len(CHECKS)}))
