"""``python -m aft_vision.run SCRIPT ARGS``: the script runs as __main__ with its arguments and sees the AFT models."""
import subprocess
import sys

import pytest

SCRIPT = '''
import sys
import timm

if __name__ == '__main__':
    name, size = sys.argv[1], int(sys.argv[2])
    model = timm.create_model(name).eval()
    shape = tuple(model(__import__('torch').randn(1, 3, size, size)).shape)
    line = f"ok {name} {shape} {sys.argv[0].endswith('s.py')}"
    print(line)
'''


def test_runs_a_script_that_relies_on_the_registry(tmp_path):
    script = tmp_path / 's.py'
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, '-m', 'aft_vision.run', str(script), 'aft_conv_test', '64'],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert 'ok aft_conv_test (1, 1000) True' in done.stdout
    plain = subprocess.run([sys.executable, str(script), 'aft_conv_test', '64'], capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode != 0 and 'Unknown model' in plain.stderr  # the registry comes from the launcher


@pytest.mark.slow
def test_runs_under_torchrun(tmp_path):
    """Both ranks run the script with the models registered. Each writes its line to a file of its own: the ranks
    share one stdout, where their prints can interleave."""
    script = tmp_path / 's.py'
    write_own_file = "    rank = __import__('os').environ['RANK']\n" \
                     "    __import__('pathlib').Path(sys.argv[0]).with_name(f'rank{rank}.txt').write_text(line)\n"
    script.write_text(SCRIPT + write_own_file)
    done = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           '-m', 'aft_vision.run', str(script), 'aft_conv_test', '64'],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f'rank{rank}.txt').read_text() == 'ok aft_conv_test (1, 1000) True', f'rank {rank}'


def test_missing_script_is_a_one_line_error(tmp_path):
    done = subprocess.run([sys.executable, '-m', 'aft_vision.run', str(tmp_path / 'nope.py')],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and 'script not found' in done.stderr and 'Traceback' not in done.stderr
