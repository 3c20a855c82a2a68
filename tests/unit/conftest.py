"""Shared fixtures for unit tests: the digits example dataset, seeded and pinned, and a digits-mlp
model trained on it once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def digits_dataset(tmp_path_factory):
    """The digits dataset in a private folder with its pinned version (:class:`tests.support.jobs.Seeded`:
    ``.folder``, ``.frame(split)``, ``.local_source``, ``.info()``). Tests must not modify it."""
    from tests.support.jobs import seed_example

    return seed_example(tmp_path_factory.mktemp("digits-private"), "digits-mlp")


@pytest.fixture(scope="session")
def trained(digits_dataset, tmp_path_factory):
    """(fp32 bundle folder of digits-mlp, the held-out split as a DataFrame): the registered builder's
    module after plain single-process training on the train split, which clears the registered gate
    (accuracy 0.85) on the held-out split. Tests must not modify either."""
    from tests.support import bundles

    seeded = digits_dataset
    data = bundles.Data("digits-mlp", seeded.folder, seeded.frame("train"), seeded.frame(seeded.entry.holdout))
    module = bundles.train("digits-mlp", data)
    bundle = bundles.make_bundle(tmp_path_factory.mktemp("trained") / "bundle", "digits-mlp", module)
    return bundle, data.test
