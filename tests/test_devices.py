"""`tfpar.devices.span`: the one device name the out-of-memory line and the mesh's
description print for a group of devices."""

from tfpar.devices import span

PREFIX = "/job:localhost/replica:0/task:0/device:CPU:"


def test_consecutive_devices_print_as_a_range():
    assert span([PREFIX + str(i) for i in range(2, 6)]) == PREFIX + "2..5"


def test_one_device_prints_its_name():
    assert span([PREFIX + "3"]) == PREFIX + "3"


def test_gaps_and_other_tasks_are_listed_not_ranged():
    gap = [PREFIX + "0", PREFIX + "2"]
    assert span(gap) == ", ".join(gap)
    tasks = [PREFIX + "0", "/job:worker/replica:0/task:1/device:CPU:1"]
    assert span(tasks) == ", ".join(tasks)
