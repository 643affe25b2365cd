# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
PIP   := $(VENV)/bin/pip
TORCH := torch==2.13.0

.PHONY: demo test test-busy etcd tools venv bench clean

# apt-get waits up to 10 minutes for another apt (unattended-upgrades on a fresh machine)
# to let go of the dpkg lock, instead of failing at once.
APT_GET := apt-get -o DPkg::Lock::Timeout=600

# apt-get update takes the package lists' lock, which DPkg::Lock::Timeout does not cover:
# it waits for that one here, the same 10 minutes, looking every 5 s.
APT_UPDATE := try=0; while :; do try=$$((try + 1)); \
	  out=$$($(APT_GET) update 2>&1) && break; \
	  case "$$out" in *"Could not get lock"*) [ $$try -lt 120 ] || { echo "$$out" >&2; exit 1; }; \
	    echo "the package lists are locked by another apt; waiting" >&2; sleep 5;; \
	  *) echo "$$out" >&2; exit 1;; esac; \
	done

# $(call apt_missing,command=package ...): install the Debian packages whose command is
# not on PATH, after one apt-get update. No recommends: prometheus's would add a node exporter.
apt_missing = @packages=""; \
	for need in $(1); do command -v "$${need%%=*}" >/dev/null 2>&1 || packages="$$packages $${need\#*=}"; done; \
	[ -z "$$packages" ] || { $(APT_UPDATE); DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y --no-install-recommends $$packages; }

etcd:
	$(call apt_missing,etcd=etcd-server)

# The suite also needs promtool (from Debian's prometheus package) to test the alert rules.
tools:
	$(call apt_missing,etcd=etcd-server promtool=prometheus)

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --disable-pip-version-check -q $(TORCH)
	$(PIP) install --disable-pip-version-check -q -e '.[train,report,test]'
	touch $@

venv: $(VENV)/.installed

demo: etcd venv
	$(VENV)/bin/regroup demo $(ARGS)

test: tools venv
	$(PY) -m pytest $(PYTEST_ARGS)

# The same suite with every core kept busy by spinning processes (it must pass on a loaded machine).
test-busy: tools venv
	$(PY) tests/busy.py $(PY) -m pytest $(PYTEST_ARGS)

bench: etcd venv
	@command -v valgrind >/dev/null 2>&1 || { $(APT_UPDATE); $(APT_GET) install -y valgrind; }  # controller --instructions
	$(PIP) install --disable-pip-version-check -q -e '.[train,report,test,bench]'
	$(PY) -m bench $(ARGS)

clean:
	rm -rf $(VENV) out .pytest_cache
