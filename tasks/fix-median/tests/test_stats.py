import sys
import unittest

sys.path.insert(0, "/app")
import stats  # noqa: E402


class Median(unittest.TestCase):
    def test_odd_unsorted(self):
        self.assertEqual(stats.median([5, 1, 3]), 3)

    def test_even(self):
        self.assertEqual(stats.median([4, 1, 3, 2]), 2.5)

    def test_single(self):
        self.assertEqual(stats.median([7]), 7)

    def test_empty(self):
        with self.assertRaises(ValueError):
            stats.median([])

    def test_input_unchanged(self):
        values = [3, 1, 2]
        stats.median(values)
        self.assertEqual(values, [3, 1, 2])


if __name__ == "__main__":
    sys.exit(not unittest.main(exit=False).result.wasSuccessful())
