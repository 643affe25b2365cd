"""What the API server does to an object on create, update, patch, delete and eviction.

The rules follow the real registry strategies of the served types: server-set metadata,
resourceVersion preconditions, status-subresource isolation, graceful pod deletion,
finalizers, and the validation that catches the mistakes a client is likely to make.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from kubeapi import budgets, patches
from kubeapi.errors import (
    ApiError,
    already_exists,
    bad_request,
    conflict,
    invalid,
    not_found,
)
from kubeapi.jsontree import clone
from kubeapi.resources import CANONICAL, NAMESPACES, POD_DISRUPTION_BUDGETS, PODS, Resource
from kubeapi.store import Key, Store
from kubeapi.validation import check_name, check_namespace, typed, validate

_SERVER_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")

WHOLE_OBJECT = "*"
"""Subresource value for in-process writes by tests, which may change spec and status at once."""

PATCH_TYPES = {
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/json-patch+json": "json",
}


def timestamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(text: str) -> datetime:
    """The moment an RFC 3339 timestamp written by `timestamp` (or with fractions) names, in UTC."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


@dataclass(frozen=True)
class DeleteOptions:
    """The parts of metav1.DeleteOptions the stand-in honours."""

    grace_period_seconds: int | None = None
    """None: the object's own default (a pod's terminationGracePeriodSeconds, else 30)."""
    uid: str | None = None
    """Precondition: delete only if the object still has this uid."""
    resource_version: str | None = None
    """Precondition: delete only if the object is still at this resourceVersion."""

    @classmethod
    def parse(cls, body: dict[str, Any] | None, query_grace: str | None) -> DeleteOptions:
        body = body or {}
        grace = body.get("gracePeriodSeconds")
        if query_grace is not None:
            grace = _integer(query_grace, "gracePeriodSeconds")
        if grace is not None and (not isinstance(grace, int) or grace < 0):
            raise bad_request(f"gracePeriodSeconds: must be a non-negative integer, got {grace!r}")
        pre = body.get("preconditions") or {}
        return cls(grace, pre.get("uid"), pre.get("resourceVersion"))


def _integer(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise bad_request(f"{name}: {text!r} is not an integer") from None


class Registry:
    """Applies the API server's rules, then writes through the Store.

    Objects returned are the stored ones: read them, never change them in place."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], datetime],
        seed: int,
        graceful_pod_deletion: bool,
    ) -> None:
        self.store = store
        self._clock = clock
        self._random = random.Random(seed)
        self.graceful_pod_deletion = graceful_pod_deletion
        """When true, deleting a running pod over HTTP only marks it (deletionTimestamp) and a
        test finishes the deletion, as a kubelet would; when false, the pod goes at once."""
        self.eviction_blocks: dict[Key, str] = {}
        """Pods whose eviction a PodDisruptionBudget (named by the value) refuses with 429,
        whatever the PodDisruptionBudget objects say."""

    # --- reads -------------------------------------------------------------------------

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        obj = self.store.get(resource.storage, (namespace, name))
        if obj is None:
            raise not_found(resource.qualified, name, resource.group, resource.plural)
        return obj

    # --- create ------------------------------------------------------------------------

    def create(self, resource: Resource, obj: dict[str, Any], namespace: str, *, from_client: bool) -> dict[str, Any]:
        """Creates `obj`, given in `resource`'s representation. `from_client`: an HTTP request, so
        server-owned fields are reset and the namespace must exist; tests calling in-process
        may set status and get namespaces made for them."""
        obj = typed(resource, clone(obj))
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata: must be an object")
        namespace = check_namespace(resource, meta, namespace)
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise invalid(
                    resource.kind,
                    "",
                    resource.group,
                    [("metadata.name", "FieldValueRequired", "Required value: name or generateName is required")],
                )
            meta["name"] = prefix + "".join(self._random.choices(string.ascii_lowercase + string.digits, k=5))
        check_name(resource, meta["name"])
        if resource.namespaced:
            self._require_namespace(namespace, create=not from_client)
        if self.store.get(resource.storage, (namespace, meta["name"])) is not None:
            raise already_exists(resource.qualified, meta["name"], resource.group, resource.plural)
        for name in _SERVER_META + ("resourceVersion", "selfLink"):
            meta.pop(name, None)
        meta["uid"] = str(uuid.UUID(int=self._random.getrandbits(128), version=4))
        meta["creationTimestamp"] = timestamp(self._clock())
        meta["generation"] = 1
        if from_client and resource.reset_status_on_create is not None:
            obj["status"] = clone(resource.reset_status_on_create)
        elif resource.default_status is not None and not obj.get("status"):
            obj["status"] = clone(resource.default_status)
        validate(resource, obj, creating=True)
        return self.store.put(resource.storage, obj)

    # --- update and patch --------------------------------------------------------------

    def replace(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        obj: dict[str, Any],
        *,
        subresource: str | None,
        from_client: bool = True,
    ) -> tuple[dict[str, Any], bool]:
        """PUT. Returns (stored, created)."""
        body, obj = obj, typed(resource, clone(obj))
        meta = obj.setdefault("metadata", {})
        check_namespace(resource, meta, namespace)
        if meta.get("name") != name:
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
            )
        old = self.store.get(resource.storage, (namespace, name))
        if old is None:
            if resource.create_on_update and subresource is None:
                return self.create(resource, body, namespace, from_client=from_client), True
            raise not_found(resource.qualified, name, resource.group, resource.plural)
        if not meta.get("resourceVersion") and not resource.unconditional_update:
            raise invalid(
                resource.kind,
                name,
                resource.group,
                [
                    (
                        "metadata.resourceVersion",
                        "FieldValueInvalid",
                        "Invalid value: 0x0: must be specified for an update",
                    )
                ],
            )
        return self._update(resource, old, obj, subresource), False

    def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: Any,
        patch_type: str,
        *,
        subresource: str | None,
    ) -> dict[str, Any]:
        """PATCH with patch_type "merge", "strategic" or "json", applied to the resource's representation."""
        old = self.store.get(resource.storage, (namespace, name))
        if old is None:
            raise not_found(resource.qualified, name, resource.group, resource.plural)
        current = resource.wire(old)  # the patch functions build a new document
        if patch_type == "merge":
            patched = patches.merge_patch(current, patch)
        elif patch_type == "strategic":
            patched = patches.strategic_merge_patch(current, patch, resource.merge_lists)
        elif patch_type == "json":
            patched = patches.json_patch(current, patch)
        else:
            raise ApiError(415, f"patch_type: {patch_type!r} is not one of merge, strategic, json")
        if not isinstance(patched, dict):
            raise ApiError(422, "the patched object is not a JSON object")
        patched = resource.unwire(patched)
        meta = patched.setdefault("metadata", {})
        if meta.get("name") != name or meta.get("namespace", "") != namespace:
            raise bad_request("metadata.name and metadata.namespace cannot be changed by a patch")
        return self._update(resource, old, patched, subresource)

    def _update(
        self, resource: Resource, old: dict[str, Any], new: dict[str, Any], subresource: str | None
    ) -> dict[str, Any]:
        name = old["metadata"]["name"]
        # Only the top level and metadata are written below; copy those, share the rest.
        new = {**new, "metadata": dict(new.get("metadata") or {})}
        meta = new["metadata"]
        rv = meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(
                resource.qualified,
                name,
                resource.group,
                resource.plural,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if meta.get("uid") and meta["uid"] != old["metadata"]["uid"]:
            raise conflict(
                resource.qualified,
                name,
                resource.group,
                resource.plural,
                f"Precondition failed: UID in precondition: {meta['uid']}, "
                f"UID in object meta: {old['metadata']['uid']}",
            )
        if subresource == "status":
            merged = {**old, "metadata": dict(old["metadata"])}
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            new = merged
        else:
            if resource.status_subresource and subresource != WHOLE_OBJECT:
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            for field_name in _SERVER_META:
                if field_name in old["metadata"]:
                    meta[field_name] = old["metadata"][field_name]
                else:
                    meta.pop(field_name, None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        validate(resource, new, creating=False)
        if new == old:
            return old  # a no-op write is not committed: no new revision, no event
        if _spec_of(new) != _spec_of(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            if not new["metadata"].get("deletionGracePeriodSeconds"):
                return self.store.remove(resource.storage, (new["metadata"].get("namespace", ""), name))
        return self.store.put(resource.storage, new)

    # --- delete and evict --------------------------------------------------------------

    def delete(
        self, resource: Resource, namespace: str, name: str, options: DeleteOptions, *, from_client: bool
    ) -> dict[str, Any]:
        """DELETE; returns the deleted object, or the object marked for deletion."""
        key = (namespace, name)
        old = self.store.get(resource.storage, key)
        if old is None:
            raise not_found(resource.qualified, name, resource.group, resource.plural)
        self._check_preconditions(resource, old, options)
        meta = old["metadata"]
        if from_client and meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds"):
            # Already terminating: only a shorter grace period changes anything (rest.BeforeDelete).
            grace = options.grace_period_seconds
            if grace is None or grace >= meta["deletionGracePeriodSeconds"]:
                return old
            if grace > 0 or meta.get("finalizers"):
                return self._mark_deleted(resource, old, grace)
            return self.store.remove(resource.storage, key)
        grace = self._grace_period(resource, old, options) if from_client else 0
        if grace > 0:
            return self._mark_deleted(resource, old, grace)
        if meta.get("finalizers"):
            return self._mark_deleted(resource, old, 0)
        if resource is NAMESPACES:
            self._delete_namespace_contents(name)
        return self.store.remove(resource.storage, key)

    def evict(self, namespace: str, name: str, eviction: dict[str, Any]) -> None:
        """POST pods/<name>/eviction, as the eviction REST handler does it: unless a disruption
        budget refuses (429, or 500 for a pod under two budgets), the pod gets the
        DisruptionTarget condition in one write, then is deleted as by DELETE in the next."""
        if not isinstance(eviction, dict):
            raise bad_request("the request body must be a policy/v1 Eviction")
        # As for any body, a missing kind defaults to the endpoint's.
        if eviction.get("kind", "Eviction") != "Eviction":
            raise bad_request(f"kind: expected Eviction, got {eviction.get('kind')!r}")
        meta = eviction.get("metadata") or {}
        if meta.get("name") != name:
            raise bad_request(f"name in URL does not match name in Eviction object: {meta.get('name')!r} != {name!r}")
        if meta.get("namespace", namespace) != namespace:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        options = DeleteOptions.parse(eviction.get("deleteOptions"), None)
        pod = self.get(PODS, namespace, name)
        if not budgets.may_skip_budgets(pod):
            blocked_by = self.eviction_blocks.get((namespace, name))
            if blocked_by is not None:
                raise budgets.budget_refusal(blocked_by, 1, 1)
            budgets.eviction_check(
                pod,
                [b for k, b in self.store.items(POD_DISRUPTION_BUDGETS.storage).items() if k[0] == namespace],
                (p for k, p in self.store.items(PODS.storage).items() if k[0] == namespace),
            )
        self._check_preconditions(PODS, pod, options)
        self._add_disruption_target(pod)
        # The condition's write moved the resourceVersion on; the handler moves a
        # resourceVersion precondition with it (addConditionAndDeletePod).
        self.delete(PODS, namespace, name, replace(options, resource_version=None), from_client=True)

    def _add_disruption_target(self, pod: dict[str, Any]) -> None:
        """Sets the DisruptionTarget condition as podutil.UpdatePodCondition does: it replaces an
        older one, keeping its lastTransitionTime when the status stays True; no change, no write."""
        status = pod.get("status") or {}
        condition: dict[str, Any] = {
            "type": "DisruptionTarget",
            "status": "True",
            "lastProbeTime": None,
            "lastTransitionTime": timestamp(self._clock()),
            "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting",
        }
        conditions = list(status.get("conditions") or [])
        for i, old in enumerate(conditions):
            if old.get("type") == condition["type"]:
                if old.get("status") == condition["status"] and old.get("lastTransitionTime"):
                    condition["lastTransitionTime"] = old["lastTransitionTime"]
                conditions[i] = condition
                break
        else:
            conditions.append(condition)
        self._update(PODS, pod, {**pod, "status": {**status, "conditions": conditions}}, "status")

    def _check_preconditions(self, resource: Resource, old: dict[str, Any], options: DeleteOptions) -> None:
        name = old["metadata"]["name"]
        if options.uid is not None and options.uid != old["metadata"]["uid"]:
            raise conflict(
                resource.qualified,
                name,
                resource.group,
                resource.plural,
                f"Precondition failed: UID in precondition: {options.uid}, "
                f"UID in object meta: {old['metadata']['uid']}",
            )
        if options.resource_version is not None and options.resource_version != old["metadata"]["resourceVersion"]:
            raise conflict(
                resource.qualified,
                name,
                resource.group,
                resource.plural,
                "Precondition failed: ResourceVersion in precondition: "
                f"{options.resource_version}, ResourceVersion in object meta: {old['metadata']['resourceVersion']}",
            )

    def _grace_period(self, resource: Resource, obj: dict[str, Any], options: DeleteOptions) -> int:
        if resource is not PODS or not self.graceful_pod_deletion:
            return 0
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        # An unscheduled or finished pod has no kubelet to wait for (pod strategy CheckGracefulDelete).
        if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
            return 0
        if options.grace_period_seconds is not None:
            return options.grace_period_seconds
        return int(spec.get("terminationGracePeriodSeconds", 30))

    def _mark_deleted(self, resource: Resource, old: dict[str, Any], grace: int) -> dict[str, Any]:
        """Sets deletionTimestamp (now + grace) and deletionGracePeriodSeconds, or shortens the
        grace of an object already terminating: its deletionTimestamp moves to the original
        request's time plus the new grace, and the generation stays (rest.BeforeDelete)."""
        meta = old["metadata"]
        marked = {**old, "metadata": dict(meta)}
        if meta.get("deletionTimestamp"):
            current = meta.get("deletionGracePeriodSeconds") or 0
            if grace >= current:
                return old
            requested = parse_timestamp(meta["deletionTimestamp"]) - timedelta(seconds=current)
            marked["metadata"]["deletionTimestamp"] = timestamp(requested + timedelta(seconds=grace))
        else:
            marked["metadata"]["deletionTimestamp"] = timestamp(self._clock() + timedelta(seconds=grace))
            marked["metadata"]["generation"] = meta.get("generation", 1) + 1
        marked["metadata"]["deletionGracePeriodSeconds"] = grace
        return self.store.put(resource.storage, marked)

    def _delete_namespace_contents(self, namespace: str) -> None:
        for resource in CANONICAL.values():
            if resource.namespaced:
                for key in [k for k in self.store.items(resource.storage) if k[0] == namespace]:
                    self.store.remove(resource.storage, key)

    # --- checks ------------------------------------------------------------------------

    def _require_namespace(self, namespace: str, *, create: bool) -> None:
        if self.store.get(NAMESPACES.storage, ("", namespace)) is not None:
            return
        if not create:
            raise not_found("namespaces", namespace, "", "namespaces")
        self.create(
            NAMESPACES,
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            "",
            from_client=False,
        )


def _spec_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}
