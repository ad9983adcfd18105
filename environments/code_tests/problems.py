"""The code-tests problems: a signature, a docstring, a reference implementation and hidden test inputs.

Expected outputs are computed from the reference at load time, so a problem is defined once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One function to write."""

    name: str
    signature: str
    doc: str
    reference: str  # the body's full source, `def` included
    inputs: tuple[tuple[Any, ...], ...]


P = Problem
PROBLEMS: tuple[Problem, ...] = (
    P(
        "is_palindrome",
        "is_palindrome(s: str) -> bool",
        "True when s reads the same backwards, ignoring case and non-alphanumeric characters.",
        "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
        (("A man, a plan, a canal: Panama",), ("hello",), ("",), ("No 'x' in Nixon",), ("ab",)),
    ),
    P(
        "fizzbuzz",
        "fizzbuzz(n: int) -> list[str]",
        "The FizzBuzz sequence from 1 to n: 'Fizz' for multiples of 3, 'Buzz' of 5, 'FizzBuzz' of both, else the number.",
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n        out.append(s or str(i))\n    return out\n",
        ((1,), (15,), (0,), (31,)),
    ),
    P(
        "gcd",
        "gcd(a: int, b: int) -> int",
        "The greatest common divisor of two non-negative integers (gcd(0, 0) == 0).",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        ((12, 18), (0, 5), (0, 0), (17, 5), (1071, 462)),
    ),
    P(
        "rle_encode",
        "rle_encode(s: str) -> str",
        "Run-length encode: each run of a character becomes the count followed by the character, e.g. 'aaab' -> '3a1b'.",
        "def rle_encode(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(f'{j - i}{s[i]}')\n        i = j\n    return ''.join(out)\n",
        (("aaab",), ("",), ("abc",), ("zzzzzzzzzzzz",), ("aabbaa",)),
    ),
    P(
        "caesar",
        "caesar(text: str, shift: int) -> str",
        "Shift each ASCII letter by `shift` places in the alphabet (wrapping, case kept); other characters unchanged.",
        "def caesar(text, shift):\n    out = []\n    for c in text:\n        if 'a' <= c <= 'z':\n            out.append(chr((ord(c) - 97 + shift) % 26 + 97))\n        elif 'A' <= c <= 'Z':\n            out.append(chr((ord(c) - 65 + shift) % 26 + 65))\n        else:\n            out.append(c)\n    return ''.join(out)\n",
        (("Hello, World!", 3), ("abc", -1), ("XYZ", 30), ("", 5)),
    ),
    P(
        "flatten",
        "flatten(items: list) -> list",
        "Flatten arbitrarily nested lists into one list, keeping order.",
        "def flatten(items):\n    out = []\n    for x in items:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out\n",
        (([1, [2, [3, [4]]], 5],), ([],), ([[[]]],), (["a", ["b"]],)),
    ),
    P(
        "rotate",
        "rotate(xs: list, k: int) -> list",
        "Rotate a list right by k places (k may be negative or larger than the length).",
        "def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[-k:] + xs[:-k] if k else list(xs)\n",
        (([1, 2, 3, 4, 5], 2), ([1, 2, 3], -1), ([], 3), ([1, 2], 5)),
    ),
    P(
        "chunk",
        "chunk(xs: list, size: int) -> list[list]",
        "Split a list into consecutive chunks of `size` (the last may be shorter).",
        "def chunk(xs, size):\n    return [xs[i:i + size] for i in range(0, len(xs), size)]\n",
        (([1, 2, 3, 4, 5], 2), ([], 3), ([1, 2, 3], 3), ([1], 5)),
    ),
    P(
        "dedupe",
        "dedupe(xs: list) -> list",
        "Drop repeated elements, keeping the first occurrence of each, in order.",
        "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out\n",
        (([3, 1, 3, 2, 1],), ([],), (["a", "a"],), ([1, 2, 3],)),
    ),
    P(
        "binary_search",
        "binary_search(xs: list[int], target: int) -> int",
        "The index of target in the sorted list xs, or -1 when absent.",
        "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n        if xs[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1\n",
        (([1, 3, 5, 7, 9], 7), ([1, 3, 5], 4), ([], 1), ([2], 2), ([1, 2, 3, 4, 5, 6], 1)),
    ),
    P(
        "transpose",
        "transpose(m: list[list[int]]) -> list[list[int]]",
        "The transpose of a rectangular matrix.",
        "def transpose(m):\n    return [list(r) for r in zip(*m)]\n",
        (([[1, 2, 3], [4, 5, 6]],), ([[1]],), ([],), ([[1, 2]],)),
    ),
    P(
        "to_roman",
        "to_roman(n: int) -> str",
        "The Roman numeral of 1 <= n <= 3999.",
        "def to_roman(n):\n    vals = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n    for v, s in vals:\n        while n >= v:\n            out += s\n            n -= v\n    return out\n",
        ((1,), (4,), (1994,), (3999,), (58,)),
    ),
    P(
        "is_anagram",
        "is_anagram(a: str, b: str) -> bool",
        "True when a and b use the same letters (case-insensitive, spaces ignored).",
        "def is_anagram(a, b):\n    f = lambda s: sorted(s.replace(' ', '').lower())\n    return f(a) == f(b)\n",
        (("listen", "silent"), ("Dormitory", "dirty room"), ("a", "b"), ("", "")),
    ),
    P(
        "count_vowels",
        "count_vowels(s: str) -> int",
        "The number of vowels (a, e, i, o, u, either case) in s.",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
        (("Hello World",), ("",), ("AEIOUxyz",), ("rhythm",)),
    ),
    P(
        "nth_fib",
        "nth_fib(n: int) -> int",
        "The n-th Fibonacci number with nth_fib(0) == 0 and nth_fib(1) == 1.",
        "def nth_fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        ((0,), (1,), (10,), (50,)),
    ),
    P(
        "is_prime",
        "is_prime(n: int) -> bool",
        "True when n is a prime number.",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n    return True\n",
        ((2,), (1,), (97,), (100,), (7919,), (-3,)),
    ),
    P(
        "digit_sum",
        "digit_sum(n: int) -> int",
        "The sum of the decimal digits of abs(n).",
        "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n",
        ((0,), (12345,), (-99,), (10**20,)),
    ),
    P(
        "reverse_words",
        "reverse_words(s: str) -> str",
        "The words of s in reverse order, separated by single spaces.",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        (("the quick brown fox",), ("  a  b ",), ("",), ("one",)),
    ),
    P(
        "balanced",
        "balanced(s: str) -> bool",
        "True when the brackets ()[]{} in s are balanced and properly nested.",
        "def balanced(s):\n    pairs, stack = {')': '(', ']': '[', '}': '{'}, []\n    for c in s:\n        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n                return False\n    return not stack\n",
        (("([]{})",), ("(]",), ("",), ("((",), ("a(b)c",)),
    ),
    P(
        "merge_sorted",
        "merge_sorted(a: list[int], b: list[int]) -> list[int]",
        "Merge two sorted lists into one sorted list.",
        "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
        (([1, 4, 9], [2, 3, 10]), ([], [1]), ([1, 1], [1]), ([], [])),
    ),
    P(
        "second_largest",
        "second_largest(xs: list[int]) -> int | None",
        "The second largest distinct value in xs, or None when there is none.",
        "def second_largest(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) >= 2 else None\n",
        (([3, 1, 4, 1, 5],), ([7, 7],), ([],), ([-1, -2],)),
    ),
    P(
        "median",
        "median(xs: list[float]) -> float",
        "The median of a non-empty list (mean of the two middle values when even).",
        "def median(xs):\n    s = sorted(xs)\n    n = len(s)\n    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\n",
        (([3, 1, 2],), ([4, 1, 3, 2],), ([5],), ([1.5, 2.5],)),
    ),
    P(
        "mode",
        "mode(xs: list[int]) -> int",
        "The most frequent value; the smallest one on a tie.",
        "def mode(xs):\n    counts = {}\n    for x in xs:\n        counts[x] = counts.get(x, 0) + 1\n    best = max(counts.values())\n    return min(k for k, v in counts.items() if v == best)\n",
        (([1, 2, 2, 3],), ([5, 4, 4, 5],), ([7],), ([3, 3, 1, 1, 2],)),
    ),
    P(
        "pascal_row",
        "pascal_row(n: int) -> list[int]",
        "Row n of Pascal's triangle (row 0 is [1]).",
        "def pascal_row(n):\n    row = [1]\n    for _ in range(n):\n        row = [a + b for a, b in zip([0] + row, row + [0])]\n    return row\n",
        ((0,), (1,), (5,), (10,)),
    ),
    P(
        "collatz_steps",
        "collatz_steps(n: int) -> int",
        "Steps for n >= 1 to reach 1 under the Collatz map (n/2 if even, 3n+1 if odd).",
        "def collatz_steps(n):\n    steps = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n        steps += 1\n    return steps\n",
        ((1,), (6,), (27,), (97,)),
    ),
    P(
        "is_armstrong",
        "is_armstrong(n: int) -> bool",
        "True when n >= 0 equals the sum of its digits each raised to the number of digits (e.g. 153).",
        "def is_armstrong(n):\n    d = str(n)\n    return n == sum(int(c) ** len(d) for c in d)\n",
        ((153,), (154,), (0,), (9474,)),
    ),
    P(
        "snake_to_camel",
        "snake_to_camel(s: str) -> str",
        "Convert snake_case to camelCase (the first word stays lower case).",
        "def snake_to_camel(s):\n    parts = s.split('_')\n    return parts[0] + ''.join(p.capitalize() for p in parts[1:])\n",
        (("hello_world",), ("a",), ("make_it_work_now",), ("",)),
    ),
    P(
        "camel_to_snake",
        "camel_to_snake(s: str) -> str",
        "Convert camelCase or PascalCase to snake_case.",
        "def camel_to_snake(s):\n    out = []\n    for i, c in enumerate(s):\n        if c.isupper() and i > 0:\n            out.append('_')\n        out.append(c.lower())\n    return ''.join(out)\n",
        (("helloWorld",), ("HTTPServer",), ("a",), ("PascalCase",)),
    ),
    P(
        "to_binary",
        "to_binary(n: int) -> str",
        "The binary representation of n >= 0 without a prefix.",
        "def to_binary(n):\n    return bin(n)[2:]\n",
        ((0,), (5,), (255,), (1024,)),
    ),
    P(
        "word_freq",
        "word_freq(text: str) -> dict[str, int]",
        "Count the words of text, lower-cased, splitting on whitespace and stripping .,!? from each word's ends.",
        "def word_freq(text):\n    out = {}\n    for w in text.lower().split():\n        w = w.strip('.,!?')\n        if w:\n            out[w] = out.get(w, 0) + 1\n    return out\n",
        (("The cat. the hat!",), ("",), ("a a a",), ("Hi, hi? HI!",)),
    ),
    P(
        "lcm",
        "lcm(a: int, b: int) -> int",
        "The least common multiple of two positive integers.",
        "def lcm(a, b):\n    x, y = a, b\n    while y:\n        x, y = y, x % y\n    return a * b // x\n",
        ((4, 6), (7, 3), (1, 1), (12, 18)),
    ),
    P(
        "max_subarray",
        "max_subarray(xs: list[int]) -> int",
        "The largest sum of a non-empty contiguous subarray.",
        "def max_subarray(xs):\n    best = cur = xs[0]\n    for x in xs[1:]:\n        cur = max(x, cur + x)\n        best = max(best, cur)\n    return best\n",
        (([-2, 1, -3, 4, -1, 2, 1, -5, 4],), ([-3],), ([1, 2, 3],), ([-1, -2],)),
    ),
    P(
        "valid_ipv4",
        "valid_ipv4(s: str) -> bool",
        "True when s is a dotted-quad IPv4 address (0-255, no leading zeros).",
        "def valid_ipv4(s):\n    parts = s.split('.')\n    if len(parts) != 4:\n        return False\n    for p in parts:\n        if not p.isdigit() or (len(p) > 1 and p[0] == '0') or int(p) > 255:\n            return False\n    return True\n",
        (("192.168.0.1",), ("256.1.1.1",), ("1.2.3",), ("01.2.3.4",), ("0.0.0.0",)),
    ),
    P(
        "compress_ranges",
        "compress_ranges(xs: list[int]) -> list[str]",
        "Summarize a sorted list of distinct ints as ranges: [0,1,2,4,6,7] -> ['0-2', '4', '6-7'].",
        "def compress_ranges(xs):\n    out, i = [], 0\n    while i < len(xs):\n        j = i\n        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:\n            j += 1\n        out.append(str(xs[i]) if i == j else f'{xs[i]}-{xs[j]}')\n        i = j + 1\n    return out\n",
        (([0, 1, 2, 4, 6, 7],), ([],), ([5],), ([1, 3, 5],)),
    ),
)
