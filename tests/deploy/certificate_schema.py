"""A hand-kept JSON schema for the cert-manager.io/v1 Certificate fields the chart writes.

No upstream cert-manager CRD is vendored with these tests (the shared reference set has KubeRay's and
the Prometheus operator's only), so this one covers exactly the fields the chart uses, named and typed
as cert-manager's v1 API documents them (CertificateSpec: secretName, secretTemplate, commonName,
dnsNames, duration, renewBefore, privateKey, usages, issuerRef). Every object is closed: a misspelt
field fails here. If the chart starts using another Certificate field, add it after checking the API.
"""
from __future__ import annotations

import jsonschema

_DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(h|m|s|ms))+$"}
_KEY_USAGES = ["signing", "digital signature", "content commitment", "key encipherment", "key agreement",
               "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
               "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
               "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}

CERTIFICATE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": {"type": "object", "additionalProperties": False, "required": ["name"],
                     "properties": {"name": {"type": "string", "maxLength": 63}, "labels": _LABELS}},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["secretName", "issuerRef"],
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "secretTemplate": {"type": "object", "additionalProperties": False,
                                   "properties": {"labels": _LABELS, "annotations": _LABELS}},
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                "duration": _DURATION,
                "renewBefore": _DURATION,
                "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "rotationPolicy": {"enum": ["Never", "Always"]}}},
                "usages": {"type": "array", "items": {"enum": _KEY_USAGES}},
                "issuerRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                              "properties": {"name": {"type": "string", "minLength": 1},
                                             "kind": {"type": "string"}, "group": {"type": "string"}}},
            },
        },
    },
}


def validate_certificate(obj: dict) -> None:
    jsonschema.validate(obj, CERTIFICATE_SCHEMA, cls=jsonschema.Draft7Validator)
