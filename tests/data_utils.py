"""Synthetic English prose for data tests that need documents the quality filters keep (a varied
vocabulary, function words, sentences) without reading the local data folder."""
import random

FUNCTION = ("the of and to in a is that for it as was with be by on not he this are or his from at which "
            "but have an they you were her she there all their one we can has been would when who will more "
            "no if out so said what up its about into than them only other new some could time these two "
            "may then do first any my now such like our over man me even most made after also did many").split()
CONTENT = ("river village mill bread flour winter summer harbor lantern copper orchard meadow valley station "
           "bridge church market council farmer teacher doctor garden letter window kitchen morning evening "
           "journey mountain forest island city road wall tower field horse ship storm fire water stone "
           "book story music painting history science law trade money family friend brother sister mother "
           "father child school house door table chair light shadow season year week hour minute people "
           "country region province capital north south east west old young small large early late quiet "
           "bright dark warm cold green red long short slow rapid heavy gentle strange simple famous rare "
           "built opened closed carried walked spoke wrote found lost kept grew moved turned reached joined "
           "crossed visited watched followed answered").split()


def english_text(rng: random.Random, n_words: int, marker: str = "") -> str:
    """Sentences of 8-16 words, about half of them function words; `marker` starts every sentence."""
    out, count = [], 0
    while count < n_words:
        k = rng.randint(8, 16)
        words = [rng.choice(FUNCTION if rng.random() < 0.45 else CONTENT) for _ in range(k)]
        if marker:
            words[0] = marker
        out.append(" ".join(words).capitalize() + ".")
        count += k
    return " ".join(out)
