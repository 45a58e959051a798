//! The server's errors: [`ApiError`], what a request gets back (an OpenAI-style JSON error object
//! with its HTTP status), and [`ServerError`], why `serve` itself stops.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An error answer: status, message, OpenAI error type, and the request field it is about.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
}

impl ApiError {
    /// 400: the field `param` (a dotted path) is wrong.
    pub fn field(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
        }
    }

    /// 400 about the request as a whole.
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "a valid API key is required: send it as `Authorization: Bearer KEY`".into(),
            kind: "authentication_error",
            param: None,
        }
    }

    pub fn unknown_model(asked: &str, served: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{asked}` does not exist; this server serves `{served}`"),
            kind: "not_found_error",
            param: Some("model".into()),
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no route {path}"),
            kind: "not_found_error",
            param: None,
        }
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is larger than {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
        }
    }

    pub fn queue_full(waiting: usize) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("the server is busy: {waiting} requests are already waiting; try again later"),
            kind: "rate_limit_error",
            param: None,
        }
    }

    pub fn loading() -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the model is still loading".into(),
            kind: "service_unavailable",
            param: None,
        }
    }

    /// 500: the engine failed on a request that was valid.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "internal_error",
            param: None,
        }
    }

    /// The JSON error object.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Why `serve` stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("loading the model: {0}")]
    Load(String),
    #[error("the server failed: {0}")]
    Io(#[from] std::io::Error),
}
