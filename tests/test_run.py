"""``python -m aft_vision.run SCRIPT ARGS``: the script runs as __main__ with its arguments and sees the AFT models."""
import subprocess
import sys

SCRIPT = '''
import sys
import timm

if __name__ == '__main__':
    name, size = sys.argv[1], int(sys.argv[2])
    model = timm.create_model(name).eval()
    print('ok', name, tuple(model(__import__('torch').randn(1, 3, size, size)).shape), sys.argv[0].endswith('s.py'))
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


def test_runs_under_torchrun(tmp_path):
    script = tmp_path / 's.py'
    script.write_text(SCRIPT + "    print('rank', __import__('os').environ['RANK'])\n")
    done = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           '-m', 'aft_vision.run', str(script), 'aft_conv_test', '64'],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count('ok aft_conv_test (1, 1000) True') == 2
    assert 'rank 0' in done.stdout and 'rank 1' in done.stdout


def test_missing_script_is_a_one_line_error(tmp_path):
    done = subprocess.run([sys.executable, '-m', 'aft_vision.run', str(tmp_path / 'nope.py')],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and 'script not found' in done.stderr and 'Traceback' not in done.stderr
